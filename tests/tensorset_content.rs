//! Content fingerprints of host-memory tensor sets, on machines without a GPU: a fingerprinted
//! commit verified by a reader in another process, a generation whose claimed fingerprint is not
//! its bytes refused, a reader that demands the fingerprint of the weights it expects, and one
//! changed tensor told apart by its digest alone. The GPU kernel is checked against the same host
//! twin in `tensorset_content_gpu.rs`.

mod common;

use common::{Peer, role, tell};
use cuda_ipc::Error;
use cuda_ipc::tensorset::content::{digest_bytes, set_fingerprint};
use cuda_ipc::tensorset::{
    DType, GenerationMode, ReaderOptions, TensorSetError, TensorSetOptions, TensorSetReader,
    TensorSetWriter, TensorSpec,
};
use std::time::Duration;

const T: Duration = Duration::from_secs(20);
const SET: &str = "CUDA_IPC_TEST_SET";
const VERIFY: &str = "a_reader_in_another_process_verifies_each_generation_and_refuses_a_false_one";

fn specs() -> Vec<TensorSpec> {
    vec![
        TensorSpec::new("embed", DType::BF16, &[64, 33]),
        TensorSpec::new("norm", DType::F32, &[3]),
        TensorSpec::new("odd", DType::U8, &[17]),
        TensorSpec::new("empty", DType::F32, &[0]),
    ]
}

/// Writes generation `g` (tensor `t` byte `k` = g * 31 + t * 7 + k) and returns its bytes.
fn fill(u: &mut cuda_ipc::tensorset::Update<'_>, g: u64, n: usize) -> Vec<Vec<u8>> {
    let mut all = Vec::new();
    for t in 0..n {
        let bytes: Vec<u8> = (0..tensor_len(t))
            .map(|k| (g as usize * 31 + t * 7 + k) as u8)
            .collect();
        u.write_tensor(t, &bytes).unwrap();
        all.push(bytes);
    }
    all
}

fn tensor_len(t: usize) -> usize {
    [64 * 33 * 2, 12, 17, 0][t]
}

#[test]
fn a_reader_in_another_process_verifies_each_generation_and_refuses_a_false_one() {
    if role().as_deref() == Some("reader") {
        let name = std::env::var(SET).unwrap();
        let r = TensorSetReader::open_host(&name, &ReaderOptions::new()).unwrap();
        let mut last = 0;
        loop {
            let h = match r.wait_newer(last, Some(T)) {
                Ok(h) => h,
                Err(Error::TensorSet(TensorSetError::Closed(_))) => break,
                Err(e) => panic!("{e}"),
            };
            last = h.generation();
            let verdict = match h.verify_content() {
                Ok(()) => "ok".to_string(),
                Err(Error::TensorSet(
                    e @ TensorSetError::ContentUnverified {
                        generation,
                        committed,
                        computed,
                    },
                )) => {
                    assert_eq!(generation, last);
                    assert_eq!(computed, h.fingerprint().unwrap());
                    assert_eq!(committed, h.content());
                    assert!(
                        e.to_string()
                            .contains("not the ones its writer fingerprinted"),
                        "{e}"
                    );
                    "mismatch".to_string()
                }
                Err(e) => format!("error {e}"),
            };
            tell(format!("gen {last} {verdict}"));
        }
        return;
    }
    for mode in [GenerationMode::InPlace, GenerationMode::Buffered(2)] {
        let name = format!(
            "tscontent-{}-{}",
            mode == GenerationMode::InPlace,
            std::process::id()
        );
        let mut w =
            TensorSetWriter::create_host(&name, &specs(), &TensorSetOptions::new().mode(mode))
                .unwrap();
        let n = w.layout().len();
        let layout = w.layout().clone();
        let mut reader = Peer::spawn(VERIFY, "reader", &[(SET, &name)]);
        for g in 1..=4u64 {
            let mut u = w.begin(Some(T)).unwrap();
            let bytes = fill(&mut u, g, n);
            let digests: Vec<[u8; 16]> = bytes.iter().map(|b| digest_bytes(b)).collect();
            assert_eq!(u.tensor_digests().unwrap(), digests);
            let expect = set_fingerprint(&layout, &digests).unwrap();
            if g == 3 {
                // A generation claiming a fingerprint its bytes do not have.
                u.commit_with_content([3; 32]).unwrap();
                assert_eq!(reader.expect("gen 3", T), "mismatch");
            } else {
                assert_eq!(u.commit_fingerprinted().unwrap(), (g, expect));
                assert_eq!(reader.expect(&format!("gen {g}"), T), "ok", "{mode:?}");
            }
        }
        w.close(T).unwrap();
        reader.finish(T);
    }
}

#[test]
fn a_reader_demanding_the_expected_weights_refuses_others_and_one_tensor_is_told_apart() {
    let name = format!("tscontent-expect-{}", std::process::id());
    let opts = TensorSetOptions::new().mode(GenerationMode::Buffered(2));
    let mut w = TensorSetWriter::create_host(&name, &specs(), &opts).unwrap();
    let n = w.layout().len();
    let mut u = w.begin(Some(T)).unwrap();
    fill(&mut u, 1, n);
    let (_, first) = u.commit_fingerprinted().unwrap();
    let r = TensorSetReader::open_host(&name, &ReaderOptions::new()).unwrap();
    // A reader demanding the first generation's weights takes it...
    let strict =
        TensorSetReader::open_host(&name, &ReaderOptions::new().expect_content(first)).unwrap();
    assert_eq!(strict.current().unwrap().unwrap().generation(), 1);
    let d1 = r.current().unwrap().unwrap().tensor_digests().unwrap();
    // Generation 2: the same bytes but one byte of tensor "odd".
    let mut u = w.begin(Some(T)).unwrap();
    let mut bytes = fill(&mut u, 1, n);
    bytes[2][16] ^= 1;
    u.write_tensor(2, &bytes[2]).unwrap();
    let (_, second) = u.commit_fingerprinted().unwrap();
    assert_ne!(first, second);
    let h = r.wait_newer(1, Some(T)).unwrap();
    let d2 = h.tensor_digests().unwrap();
    let changed: Vec<usize> = (0..n).filter(|&i| d1[i] != d2[i]).collect();
    assert_eq!(changed, vec![2]);
    drop(h);
    // ...and refuses the second.
    let e = strict.current().unwrap_err();
    assert!(
        matches!(
            e,
            Error::TensorSet(TensorSetError::ContentMismatch { generation: 2, .. })
        ),
        "{e}"
    );
    w.close(T).unwrap();
}
