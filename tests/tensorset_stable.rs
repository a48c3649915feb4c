//! Stable addresses of a tensor-set reader, what runs without a GPU: the option on a host set is
//! refused with `WrongKind` before the reader takes a slot, and a reader opened without it
//! refuses the stable calls with `InvalidArgument` and still releases the guard it was given.
//! The GPU side is in `tensorset_stable_gpu.rs`.

use cuda_ipc::Error;
use cuda_ipc::tensorset::{
    DType, GenerationMode, ReaderOptions, TensorSetError, TensorSetOptions, TensorSetReader,
    TensorSetWriter, TensorSpec,
};
use std::time::Duration;

fn specs() -> Vec<TensorSpec> {
    vec![
        TensorSpec::new("w", DType::F32, &[64]),
        TensorSpec::new("b", DType::BF16, &[8]),
    ]
}

fn commit_one(w: &mut TensorSetWriter) -> u64 {
    let mut u = w.begin(Some(Duration::from_secs(5))).unwrap();
    u.write_tensor(0, &[7u8; 256]).unwrap();
    u.commit().unwrap()
}

#[test]
fn stable_addresses_on_a_host_set_are_refused_with_wrong_kind_and_leave_no_reader_behind() {
    for mode in [GenerationMode::InPlace, GenerationMode::Buffered(2)] {
        let name = format!(
            "ts-stable-host-{}-{}",
            mode != GenerationMode::InPlace,
            std::process::id()
        );
        let opts = TensorSetOptions::new().mode(mode).max_readers(1);
        let mut w = TensorSetWriter::create_host(&name, &specs(), &opts).unwrap();
        commit_one(&mut w);
        let stable = ReaderOptions::new().stable_addresses(true);
        for open in [TensorSetReader::open_host, TensorSetReader::open_auto] {
            match open(&name, &stable) {
                Err(Error::TensorSet(TensorSetError::WrongKind(why))) => {
                    assert!(why.contains("VMM"), "{why}");
                }
                other => panic!("{mode:?}: expected WrongKind, got {other:?}"),
            }
        }
        // The refusals took no reader slot: the set's only one is free.
        let r = TensorSetReader::open_host(&name, &ReaderOptions::new()).unwrap();
        assert_eq!(r.current().unwrap().unwrap().generation(), 1);
        assert_eq!(r.stable_generation(), None);
    }
}

#[test]
fn a_reader_without_stable_addresses_refuses_the_stable_calls_and_releases_the_guard() {
    let name = format!("ts-stable-off-{}", std::process::id());
    let mut w = TensorSetWriter::create_host(&name, &specs(), &TensorSetOptions::new()).unwrap();
    commit_one(&mut w);
    let r = TensorSetReader::open_host(&name, &ReaderOptions::new()).unwrap();
    let held = r.current().unwrap().unwrap();
    // In place: a held generation keeps the writer out.
    assert!(matches!(
        w.begin(Some(Duration::from_millis(100))),
        Err(Error::Timeout { .. })
    ));
    match r.switch_stable(held) {
        Err(Error::InvalidArgument(why)) => assert!(why.contains("stable_addresses"), "{why}"),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    // The guard was consumed and released: the writer proceeds at once.
    assert_eq!(commit_one(&mut w), 2);
    assert!(matches!(r.stable_ptr(0), Err(Error::InvalidArgument(_))));
    assert!(matches!(r.stable_tensor(0), Err(Error::InvalidArgument(_))));
    assert!(matches!(r.release_stable(), Err(Error::InvalidArgument(_))));
    assert_eq!(r.stable_generation(), None);
    assert_eq!(r.current().unwrap().unwrap().generation(), 2);
}
