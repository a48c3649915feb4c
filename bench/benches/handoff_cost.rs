//! The cost of one update of a consumer's hand-off latency histogram (issue 17: "at most a few
//! tens of ns"), as every take makes it: `ControlConsumer::record_latency` on a real control
//! segment, beside its parts measured alone in the same run: the clock read (`CLOCK_MONOTONIC`
//! through the vDSO) and an empty baseline.
//!
//! `cargo bench -p cuda-ipc-bench --bench handoff_cost` (no GPU needed: a host-memory control
//! segment).

use cuda_ipc::channel::Delivery;
use cuda_ipc::raw::channel::testing::{ControlConsumer, ControlProducer};
use std::sync::OnceLock;

fn main() {
    divan::main();
    if let Some((tx, name)) = SEGMENT.get() {
        let _ = name;
        tx.unlink();
    }
}

static SEGMENT: OnceLock<(ControlProducer, String)> = OnceLock::new();

fn consumer() -> ControlConsumer {
    let (_, name) = SEGMENT.get_or_init(|| {
        let name = format!("bench-hist-{}", std::process::id());
        let tokens = [[0u8; cuda_ipc::token::TOKEN_LEN]];
        let tx = ControlProducer::create(&name, 4096, 2, &tokens).expect("a control segment");
        (tx, name)
    });
    ControlConsumer::attach(name, Delivery::EveryFrame).expect("a consumer slot")
}

/// Nothing: the harness's own cost per iteration.
#[divan::bench]
fn baseline_empty() {
    divan::black_box(());
}

/// The clock read the update starts with.
#[divan::bench]
fn clock_read() -> u32 {
    ControlConsumer::monotonic_us32()
}

/// The whole update: clock read, bucket, two stores in the consumer's slot.
#[divan::bench]
fn histogram_update(b: divan::Bencher) {
    let rx = consumer();
    let published = ControlConsumer::monotonic_us32().wrapping_sub(12);
    b.bench_local(|| rx.record_latency(divan::black_box(published)));
}
