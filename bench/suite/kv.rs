//! The `key=value` arguments of a child role.

use crate::Res;
use cuda_ipc::channel::WaitStrategy;
use std::collections::BTreeMap;
use std::str::FromStr;

/// Parsed `key=value` arguments.
#[derive(Debug, Default)]
pub struct Kv(BTreeMap<String, String>);

impl Kv {
    /// Parses `key=value` words; anything else is an error.
    pub fn parse(args: &[String]) -> Res<Kv> {
        let mut m = BTreeMap::new();
        for a in args {
            let (k, v) = a
                .split_once('=')
                .ok_or_else(|| format!("argument {a:?} is not key=value"))?;
            m.insert(k.to_string(), v.to_string());
        }
        Ok(Kv(m))
    }

    /// The value of `k` as text.
    pub fn str(&self, k: &str) -> Res<String> {
        self.0
            .get(k)
            .cloned()
            .ok_or_else(|| format!("missing argument {k}=...").into())
    }

    /// The value of `k` parsed as `T`.
    pub fn get<T: FromStr>(&self, k: &str) -> Res<T>
    where
        T::Err: std::fmt::Display,
    {
        let s = self.str(k)?;
        s.parse()
            .map_err(|e| format!("argument {k}={s}: {e}").into())
    }

    /// The value of `k` parsed as `T`, or `default` when absent.
    pub fn get_or<T: FromStr>(&self, k: &str, default: T) -> Res<T>
    where
        T::Err: std::fmt::Display,
    {
        if self.0.contains_key(k) {
            self.get(k)
        } else {
            Ok(default)
        }
    }
}

/// The wait strategies the suite compares, by the names the examples use.
pub const WAITS: [&str; 3] = ["spin-then-block", "spin", "block"];

/// Parses a wait strategy name: `spin-then-block` (the default, 50 µs of spinning), `spin`, `block`.
pub fn parse_wait(s: &str) -> Res<WaitStrategy> {
    Ok(match s {
        "spin-then-block" => WaitStrategy::default(),
        "spin" => WaitStrategy::Spin,
        "block" => WaitStrategy::Block,
        x => {
            return Err(format!("unknown wait strategy {x:?} (spin-then-block|spin|block)").into());
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_parse_and_bad_ones_are_named() {
        let kv = Kv::parse(&["frames=10".into(), "wait=spin".into()]).unwrap();
        assert_eq!(kv.get::<u64>("frames").unwrap(), 10);
        assert_eq!(kv.get_or::<u64>("gap_us", 7).unwrap(), 7);
        assert!(
            kv.get::<u64>("wait")
                .unwrap_err()
                .to_string()
                .contains("wait=spin")
        );
        assert!(kv.str("bytes").unwrap_err().to_string().contains("bytes"));
        assert!(Kv::parse(&["oops".into()]).is_err());
        assert!(parse_wait("sometimes").is_err());
        assert!(matches!(parse_wait("spin").unwrap(), WaitStrategy::Spin));
    }
}
