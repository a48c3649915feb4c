//! Files in /dev/shm named like a channel's control segment but holding something else: opening one
//! (as a consumer or an inspector) fails with a clear error, at once when the bytes cannot be a
//! segment being created; a live producer's segment whose init stamp was zeroed is told from a
//! creation in progress. Runs without a GPU.

mod common;

use cuda_ipc::channel::Delivery;
use cuda_ipc::channel::inspect;
use cuda_ipc::raw::channel::testing::ControlConsumer;
use std::time::{Duration, Instant};

/// A file `/dev/shm/cuda-ipc.ch.NAME` with `bytes`, of this user and mode 0600 (as a segment of
/// ours: one open to other users is refused for that alone), removed on drop.
struct Garbage(String);

impl Garbage {
    fn new(tag: &str, bytes: &[u8]) -> Garbage {
        let name = format!("foreign-{tag}-{}", std::process::id());
        common::plant(Garbage::path(&name), bytes);
        Garbage(name)
    }
    fn path(name: &str) -> String {
        format!("/dev/shm/{}", inspect::segment_name(name))
    }
}

impl Drop for Garbage {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(Garbage::path(&self.0));
    }
}

/// (error text of inspect, error text of attach, time both took).
fn open_both(name: &str) -> (String, String, Duration) {
    let t = Instant::now();
    let i = inspect::inspect(name).map(|_| ()).unwrap_err().to_string();
    let a = ControlConsumer::attach(name, Delivery::EveryFrame)
        .map(|_| ())
        .unwrap_err()
        .to_string();
    (i, a, t.elapsed())
}

#[test]
fn a_foreign_file_is_refused_at_once_naming_its_magic() {
    // Pseudo-random bytes: a non-zero first word that is not the channel magic.
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let bytes: Vec<u8> = (0..65536)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    let g = Garbage::new("random", &bytes);
    let (i, a, took) = open_both(&g.0);
    for e in [&i, &a] {
        assert!(
            e.contains("not a cuda-ipc channel") && e.contains("magic"),
            "{e}"
        );
    }
    assert!(took < Duration::from_secs(1), "took {took:?}");

    // Text, long enough to hold a header.
    let g = Garbage::new(
        "text",
        "this is a text file, not a channel\n"
            .repeat(100)
            .as_bytes(),
    );
    let (i, a, took) = open_both(&g.0);
    for e in [&i, &a] {
        assert!(e.contains("not a cuda-ipc channel"), "{e}");
    }
    assert!(took < Duration::from_secs(1), "took {took:?}");
}

#[test]
fn zeros_are_waited_for_as_a_creator_still_writing_then_refused() {
    // All zeros is what a segment looks like before its creator writes the header: the opener
    // waits for the init stamp, bounded, then says so: never finished after the wait, or
    // abandoned half-way as soon as it is 2 s old by `st_ctime`'s whole seconds, whichever comes
    // first.
    let g = Garbage::new("zeros", &[0u8; 8192]);
    let t = Instant::now();
    let e = inspect::inspect(&g.0).map(|_| ()).unwrap_err().to_string();
    assert!(
        e.contains("never finished") || e.contains("abandoned half-way"),
        "{e}"
    );
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t.elapsed()
    );
}

#[test]
fn truncated_and_empty_files_are_refused_as_too_small() {
    for (tag, bytes) in [("empty", &b""[..]), ("short", &b"CIPCCHAN"[..])] {
        let g = Garbage::new(tag, bytes);
        let (i, a, took) = open_both(&g.0);
        for e in [&i, &a] {
            assert!(
                e.contains("smaller than") || e.contains("empty (0 bytes)"),
                "{tag}: {e}"
            );
        }
        assert!(took < Duration::from_secs(1), "{tag}: took {took:?}");
    }
}

#[test]
fn zeros_older_than_two_seconds_are_an_abandoned_creation_told_at_once_by_every_tool() {
    // No producer recorded in a file older than 2 s: nobody will stamp it. Inspection, `gc`'s
    // removal of a dead producer's segment, its release of dead consumers and a consumer's attach
    // say so at once instead of waiting 2 s each (the attach waited, as for a young one).
    let g = Garbage::new("old-zeros", &[0u8; 16384]);
    // `st_ctime` counts whole seconds: more than 2 s by its count.
    std::thread::sleep(Duration::from_millis(3100));
    let t = Instant::now();
    let errors = [
        ControlConsumer::attach(&g.0, Delivery::EveryFrame)
            .map(|_| ())
            .unwrap_err(),
        inspect::inspect(&g.0).map(|_| ()).unwrap_err(),
        cuda_ipc::channel::reclaim::remove_stale(&g.0)
            .map(|_| ())
            .unwrap_err(),
        cuda_ipc::channel::reclaim::release_dead_consumers(&g.0)
            .map(|_| ())
            .unwrap_err(),
    ];
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "took {:?}",
        t.elapsed()
    );
    for e in errors {
        assert!(
            matches!(
                &e,
                cuda_ipc::Error::Channel(cuda_ipc::channel::ChannelError::BadSegment(
                    cuda_ipc::channel::SegmentFault::Abandoned { .. }
                ))
            ),
            "{e:?}"
        );
        assert!(e.to_string().contains("abandoned half-way"), "{e}");
    }
    // The rule a new producer replaces it by and `gc` removes it by says the same.
    assert!(inspect::abandoned(&g.0).unwrap().is_some());
    assert!(
        std::fs::metadata(Garbage::path(&g.0)).is_ok(),
        "nothing removed"
    );
}

/// Waits until `frac` of the current second has passed (of the next second when it has already).
fn at_second_fraction(frac: f64) -> Instant {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    let into = f64::from(now.subsec_nanos()) / 1e9;
    let wait = if into < frac {
        frac - into
    } else {
        1.0 - into + frac
    };
    std::thread::sleep(Duration::from_secs_f64(wait));
    Instant::now()
}

/// Zeros with no producer recorded are a creation abandoned half-way once 2 s old by
/// `st_ctime`'s whole seconds, the age by which an empty or sparse file is: at 2 by that count
/// (between 1 and 3 s of real time), an attach and an inspection refuse it at once. Before, a
/// file at 2 was still waited for (2 s), then said "never finished" by the attach and "being
/// created" by the tools, while the same file empty was already abandoned.
#[test]
fn zeros_two_seconds_old_by_their_ctime_are_refused_at_once() {
    let planted = at_second_fraction(0.05);
    let g = Garbage::new("zeros-at-two", &[0u8; 16384]);
    // 2 by `st_ctime`'s count from 1.95 s on; 3 from 2.95 s on.
    std::thread::sleep(Duration::from_millis(2300).saturating_sub(planted.elapsed()));
    let t = Instant::now();
    let i = inspect::inspect(&g.0).map(|_| ()).unwrap_err().to_string();
    let a = ControlConsumer::attach(&g.0, Delivery::EveryFrame)
        .map(|_| ())
        .unwrap_err()
        .to_string();
    let took = t.elapsed();
    for e in [&i, &a] {
        assert!(e.contains("abandoned half-way"), "{e}");
    }
    assert!(took < Duration::from_secs(1), "took {took:?}: {i} / {a}");
}

/// An opener that waits for the stamp of young zeros (no producer recorded yet: one may be about
/// to record itself) judges them again while it waits: once they are 2 s old by `st_ctime`'s
/// count, the stamp never comes, and the attach is refused then, as abandoned, not after its
/// whole 2 s wait as "never finished".
#[test]
fn an_attach_waiting_for_young_zeros_stops_when_they_come_of_age() {
    // Made late in a second: 2 by `st_ctime`'s count about 1.2 s later.
    let planted = at_second_fraction(0.8);
    let g = Garbage::new("zeros-coming-of-age", &[0u8; 16384]);
    let e = ControlConsumer::attach(&g.0, Delivery::EveryFrame)
        .map(|_| ())
        .unwrap_err()
        .to_string();
    let took = planted.elapsed();
    assert!(e.contains("abandoned half-way"), "{e}");
    assert!(
        took < Duration::from_millis(1700),
        "took {took:?}: waited past the file's coming of age"
    );
}

/// The control segment's bytes of the live channel `live` (this process its producer), with its
/// init stamp zeroed: a header as its creator leaves it between recording itself and stamping.
fn unstamped_copy_of(live: &str) -> Vec<u8> {
    use cuda_ipc::raw::channel::layout::header::STAMP;
    let mut bytes = std::fs::read(Garbage::path(live)).unwrap();
    bytes[STAMP..STAMP + 4].fill(0);
    bytes
}

/// Writes `bytes` at `at` of the file of channel `name`, as another process's stores would land.
fn write_at(name: &str, at: usize, bytes: &[u8]) {
    use std::os::unix::fs::FileExt;
    std::fs::OpenOptions::new()
        .write(true)
        .open(Garbage::path(name))
        .unwrap()
        .write_all_at(bytes, at as u64)
        .unwrap();
}

/// A live producer's control segment whose init stamp was zeroed is a bad segment that names the
/// file and says the header was overwritten, after the 2 s wait, by every opener (an attach, an
/// inspection, `gc`'s removal) and by a producer's create over it, which keeps it: not a
/// "creation in progress" (a creator stamps within milliseconds of recording itself, and this
/// one recorded itself long before) nor "never finished by its creator". The stamp put back, the
/// channel opens again.
#[test]
fn a_zeroed_stamp_under_a_live_producer_is_an_overwritten_segment_not_a_creation_in_progress() {
    use cuda_ipc::channel::{ChannelError, SegmentFault};
    use cuda_ipc::raw::channel::layout::{STAMP_READY, header::STAMP};
    use cuda_ipc::raw::channel::testing::ControlProducer;
    let n = format!("zeroed-stamp-{}", std::process::id());
    let tokens = vec![[0u8; cuda_ipc::token::TOKEN_LEN]; 2];
    let p = ControlProducer::create(&n, 4096, 2, &tokens).unwrap();
    write_at(&n, STAMP, &[0; 4]);
    let t = Instant::now();
    let errors = [
        ControlConsumer::attach(&n, Delivery::EveryFrame)
            .map(|_| ())
            .unwrap_err(),
        inspect::inspect(&n).map(|_| ()).unwrap_err(),
        cuda_ipc::channel::reclaim::remove_stale(&n)
            .map(|_| ())
            .unwrap_err(),
        ControlProducer::create(&n, 4096, 2, &tokens)
            .map(|_| ())
            .unwrap_err(),
    ];
    let took = t.elapsed();
    assert!(
        took >= Duration::from_secs(8) && took < Duration::from_secs(12),
        "four openers of a 2 s wait took {took:?}"
    );
    for e in errors {
        match &e {
            cuda_ipc::Error::Channel(ChannelError::BadSegment(SegmentFault::Overwritten {
                segment,
                waited,
            })) => {
                assert_eq!(segment, &inspect::segment_name(&n));
                assert_eq!(*waited, Duration::from_secs(2));
            }
            other => panic!("{other:?}"),
        }
        let e = e.to_string();
        assert!(
            e.contains(&format!("cuda-ipc.ch.{n} has no init stamp after 2 s"))
                && e.contains("overwritten"),
            "{e}"
        );
        assert!(
            !e.contains("being created") && !e.contains("never finished"),
            "{e}"
        );
    }
    assert!(std::fs::metadata(Garbage::path(&n)).is_ok(), "kept");
    write_at(&n, STAMP, &STAMP_READY.to_le_bytes());
    drop(ControlConsumer::attach(&n, Delivery::EveryFrame).unwrap());
    p.unlink();
}

/// A real creation stays a creation in progress: a producer that records itself late in an
/// opener's 2 s wait (less than 500 ms before its end) and has not stamped by then is
/// "never finished" for the attach and "being created by another process" for a producer's
/// create, not an overwritten header; one that records itself and stamps within the wait is
/// opened, however late in it.
#[test]
fn a_producer_recording_itself_late_in_the_wait_is_still_a_creation_in_progress() {
    use cuda_ipc::channel::{ChannelError, SegmentFault};
    use cuda_ipc::raw::channel::layout::{STAMP_READY, header::PRODUCER_PID, header::STAMP};
    use cuda_ipc::raw::channel::testing::ControlProducer;
    let live = format!("recorded-live-{}", std::process::id());
    let tokens = vec![[0u8; cuda_ipc::token::TOKEN_LEN]; 2];
    let p = ControlProducer::create(&live, 4096, 2, &tokens).unwrap();
    let header = unstamped_copy_of(&live);
    let pid = header[PRODUCER_PID..PRODUCER_PID + 4].to_vec();
    let mut unrecorded = header.clone();
    unrecorded[PRODUCER_PID..PRODUCER_PID + 4].fill(0);
    // Planted early in a second, so that its `st_ctime` does not come of age (2 by its whole
    // seconds, when a segment that records no producer is abandoned) before the producer records
    // itself, 1.7 s into the wait.
    for round in ["attach", "create"] {
        at_second_fraction(0.05);
        let g = Garbage::new(&format!("late-{round}"), &unrecorded);
        let (name, pid) = (g.0.clone(), pid.clone());
        let recorder = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(1700));
            write_at(&name, PRODUCER_PID, &pid);
        });
        let e = if round == "attach" {
            ControlConsumer::attach(&g.0, Delivery::EveryFrame)
                .map(|_| ())
                .unwrap_err()
        } else {
            ControlProducer::create(&g.0, 4096, 2, &tokens)
                .map(|_| ())
                .unwrap_err()
        };
        recorder.join().unwrap();
        match (round, &e) {
            (
                "attach",
                cuda_ipc::Error::Channel(ChannelError::BadSegment(SegmentFault::Unfinished {
                    ..
                })),
            )
            | ("create", cuda_ipc::Error::Channel(ChannelError::CreationInProgress(_))) => {}
            _ => panic!("{round}: {e:?}"),
        }
    }
    // Recorded from the start and stamped 1.5 s into the wait: opened.
    let g = Garbage::new("stamped-late", &header);
    let name = g.0.clone();
    let stamper = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(1500));
        write_at(&name, STAMP, &STAMP_READY.to_le_bytes());
    });
    let c = ControlConsumer::attach(&g.0, Delivery::EveryFrame);
    stamper.join().unwrap();
    drop(c.unwrap());
    p.unlink();
}

/// The bytes of a control segment with its init stamp zeroed and its producer's identity words
/// replaced by `dead`'s (this user's uid): what a hostile peer that maps a channel writable can
/// make of a channel in use, and what a producer killed between recording itself and stamping
/// leaves of a new one.
fn unstamped_with_dead_producer(mut bytes: Vec<u8>) -> Vec<u8> {
    use cuda_ipc::raw::channel::layout::header;
    let mut child = std::process::Command::new("true").spawn().unwrap();
    child.wait().unwrap();
    let dead = cuda_ipc::identity::ProcessIdentity {
        pid: child.id(),
        start_time: 1,
        ..cuda_ipc::identity::ProcessIdentity::current().unwrap()
    };
    let mut put = |at: usize, b: &[u8]| bytes[at..at + b.len()].copy_from_slice(b);
    put(header::STAMP, &[0; 4]);
    put(header::PRODUCER_PID, &dead.pid.to_le_bytes());
    put(header::PRODUCER_START_TIME, &dead.start_time.to_le_bytes());
    put(header::PRODUCER_BOOT_ID, &dead.boot_id);
    put(header::PRODUCER_PID_NS, &dead.pid_ns.to_le_bytes());
    put(
        header::PRODUCER_UID,
        &rustix::process::geteuid().as_raw().to_le_bytes(),
    );
    bytes
}

/// A channel in use whose header says its producer died before stamping it (the stamp zeroed and
/// the producer words overwritten with a dead process's) is no abandoned creation: consumers
/// attach, buffers are claimed and frames published only in a stamped segment. Every opener, the
/// reclaimers and a producer's create refuse it at once as a segment in use whose header was
/// overwritten, and keep it (with a consumer attached only, and with frames published too),
/// where the create and `gc` used to remove it under its users. A new channel's copy overwritten
/// the same way (a producer killed between recording itself and stamping) is still abandoned:
/// refused as such, removed by `remove_abandoned`, replaced by a create.
#[test]
fn a_channel_in_use_whose_stamp_and_producer_were_overwritten_is_kept_never_abandoned() {
    use cuda_ipc::channel::{ChannelError, SegmentFault, reclaim};
    use cuda_ipc::raw::channel::testing::ControlProducer;
    let live = format!("in-use-{}", std::process::id());
    let tokens = vec![[0u8; cuda_ipc::token::TOKEN_LEN]; 2];
    let p = ControlProducer::create(&live, 4096, 2, &tokens).unwrap();
    let fresh = std::fs::read(Garbage::path(&live)).unwrap();
    let rx = ControlConsumer::attach(&live, Delivery::EveryFrame).unwrap();
    let attached = std::fs::read(Garbage::path(&live)).unwrap();
    let (i, _) = p.try_acquire().unwrap();
    p.publish(i, b"").unwrap();
    drop(rx);
    let published = std::fs::read(Garbage::path(&live)).unwrap();
    p.unlink();
    for (tag, bytes) in [("attached", attached), ("published", published)] {
        let g = Garbage::new(tag, &unstamped_with_dead_producer(bytes));
        let t = Instant::now();
        let errors = [
            ControlConsumer::attach(&g.0, Delivery::EveryFrame)
                .map(|_| ())
                .unwrap_err(),
            inspect::inspect(&g.0).map(|_| ()).unwrap_err(),
            reclaim::remove_abandoned(&g.0).map(|_| ()).unwrap_err(),
            reclaim::remove_stale(&g.0).map(|_| ()).unwrap_err(),
            ControlProducer::create(&g.0, 4096, 2, &tokens)
                .map(|_| ())
                .unwrap_err(),
        ];
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "{tag}: {:?}",
            t.elapsed()
        );
        for e in errors {
            match &e {
                cuda_ipc::Error::Channel(ChannelError::BadSegment(
                    SegmentFault::OverwrittenInUse { segment, .. },
                )) => assert_eq!(segment, &inspect::segment_name(&g.0)),
                other => panic!("{tag}: {other:?}"),
            }
            let e = e.to_string();
            assert!(
                e.contains("in use whose header was overwritten") && e.contains("left as it is"),
                "{tag}: {e}"
            );
        }
        assert!(
            std::fs::metadata(Garbage::path(&g.0)).is_ok(),
            "{tag}: removed"
        );
    }
    // The same overwrite of a channel never used: an abandoned creation, as before.
    let g = Garbage::new("fresh", &unstamped_with_dead_producer(fresh.clone()));
    let e = ControlConsumer::attach(&g.0, Delivery::EveryFrame)
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(e.contains("abandoned half-way"), "{e}");
    assert!(reclaim::remove_abandoned(&g.0).unwrap().is_some());
    assert!(std::fs::metadata(Garbage::path(&g.0)).is_err(), "kept");
    let g = Garbage::new("fresh-replaced", &unstamped_with_dead_producer(fresh));
    let p = ControlProducer::create(&g.0, 4096, 2, &tokens).unwrap();
    p.unlink();
}
