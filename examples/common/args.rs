//! Command-line plumbing: the examples read their flags in order, each flag followed by its values.

use super::Res;
use cuda_ipc::channel::MemoryKind;
use std::error::Error;
use std::str::FromStr;

/// The arguments of this process after the program name, read front to back.
pub struct Argv {
    rest: std::vec::IntoIter<String>,
}

impl Argv {
    /// The arguments of this process (`std::env::args`), less the program name.
    pub fn from_env() -> Argv {
        Argv {
            rest: std::env::args().skip(1).collect::<Vec<_>>().into_iter(),
        }
    }

    /// The next flag (or stray word); `None` once all are read.
    pub fn flag(&mut self) -> Option<String> {
        self.rest.next()
    }

    /// The next word as the value of `flag`. Errors with `"{flag} needs a value"` when there is none.
    pub fn value(&mut self, flag: &str) -> Res<String> {
        self.value_or(&format!("{flag} needs a value"))
    }

    /// The next word; errors with `missing` when there is none.
    pub fn value_or(&mut self, missing: &str) -> Res<String> {
        self.rest.next().ok_or_else(|| missing.into())
    }

    /// The next word as the value of `flag`, parsed. Errors as [`Argv::value`] when there is none,
    /// and with the parse error (`invalid digit found in string`, ...) when it does not parse.
    pub fn parse<T>(&mut self, flag: &str) -> Res<T>
    where
        T: FromStr,
        T::Err: Error + 'static,
    {
        Ok(self.value(flag)?.parse()?)
    }
}

/// The `--memory` value of the examples that take one: the kind of exportable memory a channel's
/// pool is made of (`ChannelOptions::memory`). Errors on any word but auto, legacy, vmm and pool.
pub fn memory_kind(word: &str) -> Res<MemoryKind> {
    Ok(match word {
        "auto" => MemoryKind::Auto,
        "legacy" => MemoryKind::Legacy,
        "vmm" => MemoryKind::Vmm,
        "pool" => MemoryKind::Pool,
        x => return Err(format!("unknown memory {x:?} (auto|legacy|vmm|pool)").into()),
    })
}
