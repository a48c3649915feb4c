//! Other users' objects that `gc` passes over ([`cuda_ipc::cleanup::others`]): what `gc` says of
//! them, and `ls` of what `gc` would leave, in the same words: a line per uid in the text forms
//! ([`lines`]), an entry per object in the JSON forms ([`json`], the key `skipped`). Notes, no
//! problem: the exit status is not changed. Shared by `gc` and `ls`; imports neither.

use crate::text::{plural, user_text};
use cuda_ipc::cleanup::Skipped;
use std::collections::BTreeMap;

/// The JSON form: a list of `{name, owner, what, dead, pid}`, in the library's order (by name):
/// `name` in `/dev/shm`, `owner` the uid that owns it, `what` (`registry`, `channel segment`,
/// `host pool`, `tensor set part`, `liveness file`, `fd server socket`, `bridge status file`),
/// `dead` whether its listing found it a dead process's leftover (`false` for a segment, which is
/// not judged), `pid` of the dead process a liveness file or fd server socket names (or `null`).
pub(crate) fn json(skipped: &[Skipped]) -> serde_json::Value {
    skipped
        .iter()
        .map(|s| {
            serde_json::json!({
                "name": s.name,
                "owner": s.uid,
                "what": s.what,
                "dead": s.dead,
                "pid": s.owner.map(|o| o.pid),
            })
        })
        .collect()
}

/// `n` of `what`, in words: `1 channel segment`, `2 liveness files of dead processes`.
fn counted(n: usize, what: &str, dead: bool) -> String {
    let plural = if n == 1 {
        what.to_string()
    } else if let Some(stem) = what.strip_suffix('y') {
        format!("{stem}ies")
    } else {
        format!("{what}s")
    };
    let whose = match (dead, what, n) {
        (false, ..) => "",
        (true, "bridge status file", 1) => " of a dead bridge",
        (true, "bridge status file", _) => " of dead bridges",
        (true, _, 1) => " of a dead process",
        (true, ..) => " of dead processes",
    };
    format!("{n} {plural}{whose}")
}

/// `gc`'s words for what it skipped ([`lines`]).
pub(crate) const GC: &str = "skipped";

/// `ls`'s words for what `gc` skips ([`lines`]).
pub(crate) const LS: &str = "`cuda-ipc gc` skips";

/// The text form: one line per uid, in the order of the uids, each ending in a newline, `lead`
/// ([`GC`] or [`LS`]) first; empty when nothing was skipped. E.g. `skipped 3 objects of uid 1000
/// (alice): 2 channel segments, 1 liveness file of a dead process: another user's, left as they
/// are (theirs to clean, with `cuda-ipc gc` run as that user)`.
pub(crate) fn lines(skipped: &[Skipped], lead: &str) -> String {
    let mut by_uid: BTreeMap<u32, BTreeMap<(&str, bool), usize>> = BTreeMap::new();
    for s in skipped {
        *by_uid
            .entry(s.uid)
            .or_default()
            .entry((s.what, s.dead))
            .or_default() += 1;
    }
    by_uid
        .into_iter()
        .map(|(uid, kinds)| {
            let n: usize = kinds.values().sum();
            let what: Vec<String> = kinds
                .iter()
                .map(|((what, dead), k)| counted(*k, what, *dead))
                .collect();
            format!(
                "{lead} {} of {}: {}: another user's, left as they are (theirs to clean, with \
                 `cuda-ipc gc` run as that user)\n",
                plural(n, "object"),
                user_text(uid),
                what.join(", ")
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_read_as_words_with_whose_leftovers_they_are() {
        assert_eq!(counted(1, "registry", false), "1 registry");
        assert_eq!(counted(2, "registry", false), "2 registries");
        assert_eq!(counted(3, "channel segment", false), "3 channel segments");
        assert_eq!(
            counted(1, "liveness file", true),
            "1 liveness file of a dead process"
        );
        assert_eq!(
            counted(2, "fd server socket", true),
            "2 fd server sockets of dead processes"
        );
        assert_eq!(
            counted(2, "bridge status file", true),
            "2 bridge status files of dead bridges"
        );
        assert_eq!(lines(&[], GC), "");
    }
}
