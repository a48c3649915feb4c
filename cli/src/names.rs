//! What a NAME given to `ls`, `watch`, `metrics`, `gc` and `hold` names: the one rule, here
//! alone. Imports no command.
//!
//! - A NAME as given (`foo`, `cuda-ipc.ch.foo`) is an object's own name, the one its program gave
//!   it, never read for a prefix: the registry, the channel and the tensor set of that name, and
//!   the quota ledger of that name (a ledger has no name but its segment name,
//!   `cuda-ipc.quota.u<uid>.<device>`). `ls cuda-ipc.ch.foo` is the channel named
//!   `cuda-ipc.ch.foo` (control segment `/dev/shm/cuda-ipc.ch.cuda-ipc.ch.foo`), never channel
//!   `foo`. A registry's segment name is its own name, so a registry is looked for under a name
//!   that is another kind's file name (`cuda-ipc.ch.foo`: channel `foo`'s control segment) only
//!   when that file holds a registry.
//! - A file in `/dev/shm` is given as its path, `/dev/shm/FILE` (the only NAME with a `/`), and
//!   names the one object FILE belongs to ([`file_of`]): the registry it holds, else by its
//!   prefix, read once (`cuda-ipc.ch.FOO` and `cuda-ipc.hp.FOO`: channel `FOO`;
//!   `cuda-ipc.ts.FOO`, `.tg.`, `.td.` and `.th.`: tensor set `FOO`; `cuda-ipc.quota.…`: that
//!   quota ledger), else the registry named FILE. A process's own file (`cuda-ipc.live.…`,
//!   `cuda-ipc.fd.…`, `cuda-ipc.br.…`) is no object: refused, saying what it is.
//!
//! So every path that `ls` and `gc` print (`/dev/shm/cuda-ipc.hp.NAME`) can be given back to them
//! as it is, and no user's name is taken for another object's file.

use cuda_ipc::channel::inspect as channel_inspect;
use cuda_ipc::raw::shm::{SHM_DIR, validate_name};
use cuda_ipc::tensorset;

/// What a NAME argument is ([`parse`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Name<'a> {
    /// An object's own name, as given.
    Own(&'a str),
    /// A file in `/dev/shm`, given as `/dev/shm/FILE`: FILE.
    File(&'a str),
}

/// Reads a NAME: `/dev/shm/FILE` is [`Name::File`], anything else [`Name::Own`].
pub(crate) fn parse(arg: &str) -> Name<'_> {
    match arg
        .strip_prefix(SHM_DIR)
        .and_then(|rest| rest.strip_prefix('/'))
    {
        Some(file) => Name::File(file),
        None => Name::Own(arg),
    }
}

/// Checks a NAME of `ls`, `watch`, `metrics` or `gc` by the library's rule for segment names
/// ([`validate_name`]): an own name is one (every object's own name is a segment's, or part of
/// one), and so is the FILE of `/dev/shm/FILE`. The error says what is wrong.
pub(crate) fn validate(arg: &str) -> Result<(), String> {
    let file = match parse(arg) {
        Name::Own(n) | Name::File(n) => n,
    };
    validate_name(file).map_err(|e| {
        if arg.contains('/') && matches!(parse(arg), Name::Own(_)) {
            format!("{e}; a file in {SHM_DIR} is given as {SHM_DIR}/FILE")
        } else {
            e.to_string()
        }
    })
}

/// Whose file a file name in `/dev/shm` is, by its prefix alone ([`file_of`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FileOf<'a> {
    /// A part of this channel (control segment or host pool).
    Channel(&'a str),
    /// A part of this tensor set (manifest, generation channel, host data, holders).
    Set(&'a str),
    /// A quota ledger (its own name is its file name).
    Ledger,
    /// A process's own file, no object; the words say which.
    Process(&'static str),
    /// None of those prefixes: a registry's (its own name is its file name).
    Registry,
}

/// The segment name prefixes of a channel's parts (control segment, host pool).
const CHANNEL_PARTS: [&str; 2] = [
    channel_inspect::SEGMENT_PREFIX,
    channel_inspect::POOL_PREFIX,
];

/// The segment name prefixes of a tensor set's parts (manifest, generation channel, host data,
/// holders).
pub(crate) const SET_PARTS: [&str; 4] = [
    tensorset::MANIFEST_PREFIX,
    tensorset::GENERATION_PREFIX,
    tensorset::DATA_PREFIX,
    tensorset::HOLDERS_PREFIX,
];

/// The prefixes of a process's own files in `/dev/shm` (none of them an object a NAME can name),
/// each with what it is.
const PROCESS_FILES: [(&str, &str); 3] = [
    (cuda_ipc::identity::LIVE_PREFIX, "a process's liveness file"),
    (
        cuda_ipc::ipc::fdpass::SOCKET_PREFIX,
        "a process's fd server socket",
    ),
    (
        cuda_ipc::cleanup::BRIDGE_PREFIX,
        "a lane bridge's status file",
    ),
];

/// Whose file `file` (a name in `/dev/shm`, without the folder) is by its prefix, stripped once:
/// `cuda-ipc.ch.cuda-ipc.ch.foo` is channel `cuda-ipc.ch.foo`'s. A prefix with nothing after it
/// is no part of anything: [`FileOf::Registry`]. Whether the file holds a registry (which may bear
/// any name) is for the caller to look at.
pub(crate) fn file_of(file: &str) -> FileOf<'_> {
    let rest = |prefixes: &[&str]| {
        prefixes
            .iter()
            .find_map(|p| file.strip_prefix(p).filter(|r| !r.is_empty()))
    };
    if let Some(c) = rest(&CHANNEL_PARTS) {
        return FileOf::Channel(c);
    }
    if let Some(s) = rest(&SET_PARTS) {
        return FileOf::Set(s);
    }
    if rest(&[cuda_ipc::quota::LEDGER_PREFIX]).is_some() {
        return FileOf::Ledger;
    }
    match PROCESS_FILES
        .iter()
        .find(|(p, _)| file.strip_prefix(p).is_some_and(|r| !r.is_empty()))
    {
        Some((_, what)) => FileOf::Process(what),
        None => FileOf::Registry,
    }
}

/// The error for a NAME that is a process's own file (`file` in `/dev/shm`, what it is).
pub(crate) fn process_file(file: &str, what: &str) -> String {
    format!(
        "{SHM_DIR}/{file} is {what}, not a registry, channel or tensor set: `cuda-ipc gc` without \
         a NAME removes those of killed processes, and `cuda-ipc ls` shows the objects"
    )
}

/// The tensor set a NAME of `hold` names: its own name ([`tensorset::validate_set_name`]), or
/// `/dev/shm/FILE` of one of its parts (`cuda-ipc.ts.NAME`, `.tg.`, `.td.`, `.th.`). The error
/// says what is wrong.
pub(crate) fn set_of(arg: &str) -> Result<&str, String> {
    let set = match parse(arg) {
        Name::Own(n) => n,
        Name::File(f) => match file_of(f) {
            FileOf::Set(s) => s,
            _ => {
                return Err(format!(
                    "{arg} is no file of a tensor set ({SHM_DIR}/{}NAME, or a part's: .tg., .td., \
                     .th.)",
                    tensorset::MANIFEST_PREFIX
                ));
            }
        },
    };
    tensorset::validate_set_name(set).map_err(|e| e.to_string())?;
    Ok(set)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_as_given_is_an_own_name_and_a_path_in_dev_shm_a_file() {
        assert_eq!(parse("foo"), Name::Own("foo"));
        assert_eq!(parse("cuda-ipc.ch.foo"), Name::Own("cuda-ipc.ch.foo"));
        assert_eq!(
            parse("/dev/shm/cuda-ipc.ch.foo"),
            Name::File("cuda-ipc.ch.foo")
        );
        assert_eq!(parse("/dev/shmx/foo"), Name::Own("/dev/shmx/foo"));
        assert!(validate("cuda-ipc.ts.foo").is_ok());
        assert!(validate("/dev/shm/cuda-ipc.ts.foo").is_ok());
        for bad in ["/dev/shm/", "/dev/shm/a/b", "/dev/shm/..", "/x", "a/b", ""] {
            assert!(validate(bad).is_err(), "{bad}");
        }
        assert!(validate("/x").unwrap_err().contains("/dev/shm/FILE"));
    }

    #[test]
    fn a_file_names_its_object_by_its_prefix_stripped_once() {
        assert_eq!(file_of("cuda-ipc.ch.foo"), FileOf::Channel("foo"));
        assert_eq!(
            file_of("cuda-ipc.ch.cuda-ipc.ch.foo"),
            FileOf::Channel("cuda-ipc.ch.foo")
        );
        assert_eq!(file_of("cuda-ipc.hp.foo"), FileOf::Channel("foo"));
        for p in SET_PARTS {
            assert_eq!(
                file_of(&format!("{p}cuda-ipc.ts.foo")),
                FileOf::Set("cuda-ipc.ts.foo")
            );
        }
        assert_eq!(file_of("cuda-ipc.quota.u0.host"), FileOf::Ledger);
        assert!(matches!(
            file_of("cuda-ipc.live.1.2.3"),
            FileOf::Process(w) if w.contains("liveness")
        ));
        for registry in ["foo", "cuda-ipc.ch.", "cuda-ipc.x.foo"] {
            assert_eq!(file_of(registry), FileOf::Registry, "{registry}");
        }
    }

    #[test]
    fn hold_takes_a_sets_own_name_or_a_path_of_one_of_its_parts() {
        assert_eq!(set_of("cuda-ipc.ts.foo"), Ok("cuda-ipc.ts.foo"));
        assert_eq!(set_of("/dev/shm/cuda-ipc.ts.foo"), Ok("foo"));
        assert_eq!(set_of("/dev/shm/cuda-ipc.th.foo"), Ok("foo"));
        assert!(set_of("/dev/shm/cuda-ipc.ch.foo").is_err());
        assert!(set_of("/dev/shm/cuda-ipc.ts.").is_err());
    }
}
