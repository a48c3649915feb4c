//! Hostile files under a registry's name, and registries superseded under their holders.
//!
//! `/dev/shm` is writable by everyone, so anyone can put a FIFO, a directory, a symbolic link or a
//! sparse file where a registry is expected. Every registry opener meets each of them in a child
//! process bounded by a timeout: the outcome is an error, never a panic, a hang or a `SIGBUS`.

mod common;

use common::{Unlink, role, unique};
use cuda_ipc::Error;
use cuda_ipc::raw::registry_layout as layout;
use cuda_ipc::raw::shm::Segment;
use cuda_ipc::raw::shm::ShmError;
use cuda_ipc::registry::{Registry, RegistryError, RegistryOptions, inspect};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const NAME: &str = "CUDA_IPC_TEST_HOSTILE_NAME";
const KINDS: [&str; 4] = ["fifo", "directory", "symlink", "sparse"];

fn opts() -> RegistryOptions {
    RegistryOptions::new()
        .capacity(4)
        .participants(4)
        .init_timeout(Duration::from_millis(100))
        .lock_timeout(Duration::from_millis(200))
}

fn path(name: &str) -> String {
    format!("/dev/shm/{name}")
}

/// Puts a hostile file of `kind` under `name`; returns the symlink target's guard when there is one.
fn plant(kind: &str, name: &str) -> Option<Unlink> {
    let p = path(name);
    match kind {
        "fifo" => {
            let c = std::ffi::CString::new(p).unwrap();
            // SAFETY: `c` is a valid NUL-terminated path.
            assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
            None
        }
        "directory" => {
            std::fs::create_dir(&p).unwrap();
            None
        }
        "symlink" => {
            // Pointing at a real, initialised registry: it must not be opened through the link.
            let target = unique("hostile-target");
            let reg = Registry::create(&target, &opts()).unwrap();
            reg.publish("secret", 1, b"", b"").unwrap();
            std::os::unix::fs::symlink(path(&target), &p).unwrap();
            Some(Unlink(target))
        }
        "sparse" => {
            // The first page of a valid registry, the rest holes: mapping it and touching a hole
            // in a full /dev/shm would raise SIGBUS. Of mode 0600, as a registry of this user's
            // (one open to other users is refused for that before it is looked at).
            let src = unique("hostile-src");
            let reg = Registry::create(&src, &opts()).unwrap();
            let seg = reg.segment();
            let head: Vec<u8> = (0..layout::HEADER_SIZE)
                // SAFETY: in bounds; no other process has the segment.
                .map(|i| unsafe { seg.as_ptr().add(i).read_volatile() })
                .collect();
            let len = seg.len() as u64 + (1 << 20);
            drop(reg);
            let _ = Segment::unlink(&src);
            let f = common::plant(&p, &head);
            f.set_len(len).unwrap();
            None
        }
        other => panic!("unknown kind {other}"),
    }
}

fn remove(name: &str) {
    let p = path(name);
    let _ = std::fs::remove_dir(&p);
    let _ = std::fs::remove_file(&p);
}

/// In the child: every opener on the hostile name; prints one line per opener.
fn every_opener(kind: &str, name: &str) {
    let results: Vec<(&str, Result<(), Error>)> = vec![
        ("open", Registry::open(name, &opts()).map(|_| ())),
        (
            "open_or_create",
            Registry::open_or_create(name, &opts()).map(|_| ()),
        ),
        ("create", Registry::create(name, &opts()).map(|_| ())),
        ("inspect", inspect::inspect(name).map(|_| ())),
    ];
    for (opener, r) in results {
        let e = r.expect_err(&format!("{opener} accepted a {kind}"));
        let typed = match (kind, &e) {
            ("fifo", Error::Shm(ShmError::NotASegment { kind: "FIFO", .. })) => true,
            (
                "directory",
                Error::Shm(ShmError::NotASegment {
                    kind: "directory", ..
                }),
            ) => true,
            // What stands under the name, as for a FIFO (it was an `InvalidArgument`).
            (
                "symlink",
                Error::Shm(ShmError::NotASegment {
                    kind: "symbolic link",
                    ..
                }),
            ) => true,
            ("sparse", Error::Shm(ShmError::Sparse { .. })) => true,
            (_, Error::Shm(ShmError::AlreadyExists { .. })) => opener == "create",
            _ => false,
        };
        assert!(typed, "{opener} on a {kind}: {e}");
        println!("{opener}: {e}");
    }
    // A sparse file with the magic is listed (a regular file, read, never mapped), so tools report
    // it through `inspect`'s error; nothing else is.
    let listed = inspect::list_registries()
        .unwrap()
        .contains(&name.to_string());
    assert_eq!(listed, kind == "sparse", "{kind}");
    println!("listed: {}", if listed { "yes" } else { "no" });
}

#[test]
fn hostile_files_under_a_registry_name_give_errors_for_every_opener_never_a_hang() {
    if let Some(r) = role() {
        let name = std::env::var(NAME).unwrap();
        return every_opener(&r, &name);
    }
    for kind in KINDS {
        let name = unique(&format!("hostile-{kind}"));
        let _target = plant(kind, &name);
        let exe = std::env::current_exe().unwrap();
        let mut child = Command::new(exe)
            .args([
                "hostile_files_under_a_registry_name_give_errors_for_every_opener_never_a_hang",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(common::ROLE, kind)
            .env(NAME, &name)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let t = Instant::now();
        let status = loop {
            if let Some(st) = child.try_wait().unwrap() {
                break Some(st);
            }
            if t.elapsed() > Duration::from_secs(20) {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let mut out = String::new();
        std::io::Read::read_to_string(child.stdout.as_mut().unwrap(), &mut out).unwrap();
        // Still there, untouched: nothing was replaced.
        let still = std::fs::symlink_metadata(path(&name)).is_ok();
        remove(&name);
        let status = status.unwrap_or_else(|| panic!("a {kind}: an opener hung\n{out}"));
        assert!(status.success(), "a {kind}: {status}\n{out}");
        assert!(out.contains("listed: "), "{out}");
        assert!(still, "the {kind} was removed");
    }
}

#[test]
fn listing_skips_fifos_directories_links_and_sparse_files_without_blocking() {
    let mut names = Vec::new();
    let mut guards = Vec::new();
    for kind in KINDS {
        let name = unique(&format!("hostile-ls-{kind}"));
        guards.push(plant(kind, &name));
        names.push(name);
    }
    let real = unique("hostile-ls-real");
    let _u = Unlink(real.clone());
    let _reg = Registry::create(&real, &opts()).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(inspect::list_registries());
    });
    let listed = rx.recv_timeout(Duration::from_secs(10));
    for n in &names {
        remove(n);
    }
    let listed = listed.expect("list_registries hung").unwrap();
    assert!(listed.contains(&real));
    // The sparse file holds a valid header: it is a regular file, read (never mapped); the others
    // are not listed.
    for (kind, n) in KINDS.iter().zip(&names) {
        assert_eq!(listed.contains(n), *kind == "sparse", "{kind}: {listed:?}");
    }
}

#[test]
fn a_wait_on_a_superseded_registry_ends_within_a_second() {
    let name = unique("superseded");
    let _u = Unlink(name.clone());
    let old = Registry::create(&name, &opts()).unwrap();
    let first_generation = old.generation();
    assert_ne!(first_generation, 0);
    std::thread::scope(|s| {
        let h = s.spawn(|| {
            let t = Instant::now();
            let r = old.wait_for("never", 0, Duration::from_secs(30));
            (r, t.elapsed())
        });
        std::thread::sleep(Duration::from_millis(200));
        Registry::unlink(&name).unwrap();
        let t = Instant::now();
        let new = Registry::create(&name, &opts()).unwrap();
        assert_ne!(new.generation(), first_generation);
        let (r, _) = h.join().unwrap();
        let e = r.unwrap_err();
        assert!(
            matches!(e, Error::Registry(RegistryError::Superseded { .. })),
            "{e}"
        );
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        assert!(e.to_string().contains("open it again"), "{e}");
        // Fast paths do not look: the old mapping still answers.
        assert!(old.get("never").unwrap().is_none());
        // Reopening gets the new one.
        let again = Registry::open(&name, &opts()).unwrap();
        assert_eq!(again.generation(), new.generation());
        again.check_superseded().unwrap();
    });
}

#[test]
fn a_lock_wait_on_a_superseded_registry_ends_within_a_second() {
    let name = unique("superseded-lock");
    let _u = Unlink(name.clone());
    let o = opts().lock_timeout(Duration::from_secs(30));
    let old = Registry::create(&name, &o).unwrap();
    let holder = Registry::open(&name, &o).unwrap();
    // The table lock held by a live participant (another handle of this process) for good.
    let off = layout::PARTICIPANTS_OFFSET
        + holder.participant_index() as usize * layout::PARTICIPANT_SIZE
        + 8;
    // SAFETY: in bounds (participant entries follow the header), aligned, atomic accesses.
    let (name_word, table_lock) = unsafe {
        (
            &*(old.segment().as_ptr().add(off) as *const std::sync::atomic::AtomicU64),
            &*(old.segment().as_ptr().add(72) as *const std::sync::atomic::AtomicU64),
        )
    };
    table_lock.store(
        name_word.load(std::sync::atomic::Ordering::SeqCst),
        std::sync::atomic::Ordering::SeqCst,
    );
    std::thread::scope(|s| {
        let h = s.spawn(|| old.publish("new-name", 1, b"", b""));
        std::thread::sleep(Duration::from_millis(200));
        Registry::unlink(&name).unwrap();
        let t = Instant::now();
        let _new = Registry::create(&name, &o).unwrap();
        let e = h.join().unwrap().unwrap_err();
        assert!(
            matches!(e, Error::Registry(RegistryError::Superseded { .. })),
            "{e}"
        );
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    });
}

#[test]
fn a_registry_whose_name_was_only_removed_is_not_superseded() {
    let name = unique("removed-only");
    let reg = Registry::create(&name, &opts()).unwrap();
    Registry::unlink(&name).unwrap();
    reg.check_superseded().unwrap();
    let e = reg
        .wait_for("x", 0, Duration::from_millis(600))
        .unwrap_err();
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
}
