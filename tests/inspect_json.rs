//! The `serde` form of the inspection snapshots (`registry::inspect`, `channel::inspect`), which
//! `cuda-ipc ls --json` prints: the keys and values each snapshot type documents.
#![cfg(feature = "serde")]

use cuda_ipc::channel::Delivery;
use cuda_ipc::channel::inspect as channel_inspect;
use cuda_ipc::identity::ProcessIdentity;
use cuda_ipc::raw::channel::testing::{ControlConsumer, ControlProducer};
use cuda_ipc::registry::{Registry, RegistryOptions, inspect as registry_inspect};
use cuda_ipc::token::{TOKEN_LEN, Token, TokenKind};
use serde_json::{Value, json};
use std::time::Duration;

fn token(i: u8, kind: TokenKind) -> [u8; TOKEN_LEN] {
    Token {
        kind,
        handle: [i; 64],
        offset: 0,
        len: 4096,
        device: cuda_ipc::driver::Uuid([0xab; 16]),
        export_id: 0,
        exporter: ProcessIdentity::current().unwrap(),
    }
    .to_bytes()
}

fn keys(v: &Value) -> Vec<&str> {
    let mut k: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
    k.sort();
    k
}

#[test]
fn a_registry_snapshot_serialises_records_as_lengths_and_liveness_as_words() {
    let name = format!("cuda-ipc-test-inspect-json-{}", std::process::id());
    let reg = Registry::create(&name, &RegistryOptions::new().capacity(4)).unwrap();
    let seq = reg.publish("frames", 7, b"token", b"meta").unwrap();
    let v = serde_json::to_value(registry_inspect::inspect(&name).unwrap()).unwrap();
    Registry::unlink(&name).unwrap();
    let me = std::process::id();

    assert_eq!(v["name"], name.as_str());
    assert_eq!(
        (v["capacity"].as_u64(), v["last_seq"].as_u64()),
        (Some(4), Some(seq))
    );
    assert_eq!(v["creator_pid"], me);
    assert_eq!(keys(&v["creator"]), ["pid", "pid_ns", "start_time"]);
    assert_eq!(v["corrupt_slots"], json!([]));
    assert_eq!(v["locked_slots"], json!([]));
    let r = &v["records"][0];
    assert_eq!(
        keys(r),
        [
            "kind",
            "metadata_bytes",
            "name",
            "owner",
            "owner_pid",
            "seq",
            "slot",
            "token_bytes"
        ]
    );
    assert_eq!(r["name"], "frames");
    assert_eq!(
        (r["kind"].as_u64(), r["seq"].as_u64()),
        (Some(7), Some(seq))
    );
    assert_eq!(
        (r["token_bytes"].as_u64(), r["metadata_bytes"].as_u64()),
        (Some(5), Some(4))
    );
    assert_eq!(
        (&r["owner_pid"], &r["owner"]),
        (&json!(me), &json!("alive"))
    );
    let p = &v["participants"][0];
    assert_eq!(
        keys(p),
        [
            "alive",
            "index",
            "liveness",
            "pid",
            "pid_ns",
            "sealed",
            "start_time"
        ]
    );
    assert_eq!(
        (&p["pid"], &p["alive"], &p["liveness"]),
        (&json!(me), &json!(true), &json!("alive"))
    );
    drop(reg);
}

#[test]
fn a_channel_snapshot_serialises_states_policies_masks_and_tokens_as_documented() {
    let name = format!("inspect-json-{}", std::process::id());
    let l = TokenKind::LegacyMemory;
    // Buffer 1's token does not decode.
    let tx = ControlProducer::create(&name, 4096, 4, &[token(1, l), [0; TOKEN_LEN]]).unwrap();
    let rx = ControlConsumer::attach(&name, Delivery::LatestOnly).unwrap();
    let (i, _) = tx.try_acquire().unwrap();
    tx.publish(i, b"meta").unwrap();
    let (held, seq, _) = rx.take(Some(Duration::from_secs(1))).unwrap().unwrap();
    assert_eq!(held, 0, "the producer fills the first free buffer");
    let v = serde_json::to_value(channel_inspect::inspect(&name).unwrap()).unwrap();
    rx.release(held);
    drop(rx);
    tx.unlink();
    let me = std::process::id();

    assert_eq!(
        (&v["producer_pid"], &v["producer"]),
        (&json!(me), &json!("alive"))
    );
    assert_eq!((&v["state"], &v["closed"]), (&json!("open"), &json!(false)));
    assert_eq!(v["head"], seq);
    let b = &v["buffers"][held];
    assert_eq!(
        keys(b),
        [
            "bytes",
            "device",
            "holders",
            "index",
            "metadata_bytes",
            "seq",
            "state",
            "used_mask"
        ]
    );
    assert_eq!((&b["state"], &b["seq"]), (&json!("frame"), &json!(seq)));
    assert_eq!(b["holders"], json!([0]));
    assert_eq!(
        (b["bytes"].as_u64(), b["metadata_bytes"].as_u64()),
        (Some(4096), Some(4))
    );
    assert_eq!(b["device"], "GPU-abababab-abab-abab-abab-abababababab");
    let undecodable = &v["buffers"][1];
    assert_eq!(
        (&undecodable["state"], &undecodable["seq"]),
        (&json!("empty"), &Value::Null)
    );
    assert_eq!(
        (&undecodable["bytes"], &undecodable["device"]),
        (&Value::Null, &Value::Null)
    );
    let c = &v["consumers"][0];
    assert_eq!((&c["pid"], &c["process"]), (&json!(me), &json!("alive")));
    assert_eq!(
        (&c["state"], &c["delivery"]),
        (&json!("attached"), &json!("latest-only"))
    );
    assert_eq!(c["holds"], json!([held]));
    assert!(
        c.get("identity").is_none() && c.get("boot_id").is_none(),
        "{c}"
    );
}
