//! The words and numbers the commands print: liveness, delivery policies and states as the JSON
//! form writes them, byte counts, users. Shared by the commands; imports none of them.

use cuda_ipc::channel::Delivery;
use cuda_ipc::channel::inspect::{ConsumerState, ProducerState, UnknownCode};
use cuda_ipc::identity::Liveness;

pub(crate) fn liveness(l: Liveness) -> &'static str {
    match l {
        Liveness::Alive => "alive",
        Liveness::Dead => "dead",
        _ => "unknown",
    }
}

/// A consumer's delivery policy as shown: a code this build does not know is shown as
/// `unknown(N)`, never as one of the policies.
pub(crate) fn delivery_name(d: Result<Delivery, UnknownCode>) -> String {
    match d {
        Ok(Delivery::EveryFrame) => "every-frame".to_string(),
        Ok(Delivery::LatestOnly) => "latest-only".to_string(),
        Ok(other) => format!("{other:?}"),
        Err(e) => format!("unknown({})", e.code),
    }
}

/// A consumer slot's state as shown; an unknown code is shown as `unknown(N)`.
pub(crate) fn consumer_state_name(s: Result<ConsumerState, UnknownCode>) -> String {
    match s {
        Ok(ConsumerState::Active) => "attached".to_string(),
        Ok(ConsumerState::Claiming) => "attaching".to_string(),
        Ok(other) => format!("{other:?}").to_lowercase(),
        Err(e) => format!("unknown({})", e.code),
    }
}

/// The producer's state as shown; an unknown code is shown as `unknown(N)`.
pub(crate) fn producer_state_name(s: Result<ProducerState, UnknownCode>) -> String {
    match s {
        Ok(ProducerState::Open) => "open".to_string(),
        Ok(ProducerState::Closed) => "closed".to_string(),
        Ok(other) => format!("{other:?}").to_lowercase(),
        Err(e) => format!("unknown({})", e.code),
    }
}

/// How the commands write a count in words (`1 byte`, `2 bytes`, `0 generations`): the library's
/// own spelling.
pub(crate) use cuda_ipc::error::plural;

/// `1234 B`, `31.6 MiB`.
pub(crate) fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64 / 1024.0;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.1} {}", UNITS[u])
}

/// The name of user `uid` in `/etc/passwd`, if it has one there.
fn user_name(uid: u32) -> Option<String> {
    let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|l| {
        let mut f = l.split(':');
        let name = f.next()?;
        (f.nth(1)?.parse::<u32>().ok()? == uid).then(|| name.to_string())
    })
}

/// `uid 0 (root)`, or `uid 1234` where the uid has no name here.
pub(crate) fn user_text(uid: u32) -> String {
    match user_name(uid) {
        Some(n) => format!("uid {uid} ({n})"),
        None => format!("uid {uid}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_count_of_one_is_singular_and_every_other_plural() {
        assert_eq!(plural(1u64, "byte"), "1 byte");
        assert_eq!(plural(0usize, "byte"), "0 bytes");
        assert_eq!(plural(2, "dead holder slot"), "2 dead holder slots");
    }

    #[test]
    fn byte_counts_read_like_people_write_them() {
        assert_eq!(bytes(0), "0 B");
        assert_eq!(bytes(1023), "1023 B");
        assert_eq!(bytes(3840 * 2160 * 4), "31.6 MiB");
        assert_eq!(bytes(1 << 40), "1.0 TiB");
    }

    #[test]
    fn unknown_policy_and_state_codes_are_shown_as_unknown_never_as_a_known_one() {
        assert_eq!(delivery_name(Ok(Delivery::EveryFrame)), "every-frame");
        assert_eq!(delivery_name(Ok(Delivery::LatestOnly)), "latest-only");
        assert_eq!(delivery_name(Delivery::from_wire(7)), "unknown(7)");
        assert_eq!(delivery_name(Delivery::from_wire(1)), "latest-only");
        assert_eq!(consumer_state_name(ConsumerState::from_wire(2)), "attached");
        assert_eq!(
            consumer_state_name(ConsumerState::from_wire(1)),
            "attaching"
        );
        assert_eq!(
            consumer_state_name(ConsumerState::from_wire(9)),
            "unknown(9)"
        );
        assert_eq!(producer_state_name(ProducerState::from_wire(0)), "open");
        assert_eq!(producer_state_name(ProducerState::from_wire(1)), "closed");
        assert_eq!(
            producer_state_name(ProducerState::from_wire(5)),
            "unknown(5)"
        );
    }

    #[test]
    fn the_tables_use_the_words_of_the_json_form() {
        let word = |v: serde_json::Value| v.as_str().unwrap().to_string();
        for l in [Liveness::Alive, Liveness::Dead, Liveness::Unknown] {
            assert_eq!(liveness(l), word(serde_json::json!(l)));
        }
        for d in [Delivery::EveryFrame, Delivery::LatestOnly] {
            assert_eq!(delivery_name(Ok(d)), word(serde_json::json!(d)));
        }
        for c in [ConsumerState::Claiming, ConsumerState::Active] {
            assert_eq!(consumer_state_name(Ok(c)), word(serde_json::json!(c)));
        }
        for p in [ProducerState::Open, ProducerState::Closed] {
            assert_eq!(producer_state_name(Ok(p)), word(serde_json::json!(p)));
        }
    }
}
