//! `quota set|show|remove`: the per-device budgets of `cuda_ipc::quota`, and the lines `ls` and
//! `doctor` show of them.

use crate::Outcome;
use crate::text::{bytes, plural, user_text};
use cuda_ipc::driver::Uuid;
use cuda_ipc::quota::{LedgerSnapshot, QuotaLedger, QuotaScope, UNLIMITED, list_ledgers};
use std::error::Error;

/// A size as people write it: `8GiB`, `512MiB`, `1.5G`, `4096`, `10 kB`; `unlimited` (or `none`)
/// for no limit. Binary (`KiB`, `K`, `k`) and decimal (`kB`, `MB`, `GB`, `TB`) units. Computed
/// exactly (no floating point): a size that comes to a fraction of a byte (`1.5`, `0.3 KiB`), a
/// negative one, one of 2^64 bytes or more, or one with more than 38 digits after the point
/// (trailing zeros not counted) is refused with the reason.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    if t.eq_ignore_ascii_case("unlimited") || t.eq_ignore_ascii_case("none") {
        return Ok(UNLIMITED);
    }
    if t.starts_with('-') {
        return Err(format!("{s:?} is negative: a budget is 0 bytes or more"));
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let not_a_size = || format!("{s:?} is not a size (e.g. 8GiB, 512MiB, 4096)");
    let (whole, frac) = num.split_once('.').unwrap_or((num, ""));
    if (whole.is_empty() && frac.is_empty()) || frac.contains('.') {
        return Err(not_a_size());
    }
    let mult: u128 = match unit.trim() {
        "" | "B" => 1,
        "K" | "k" | "KiB" => 1 << 10,
        "M" | "MiB" => 1 << 20,
        "G" | "GiB" => 1 << 30,
        "T" | "TiB" => 1 << 40,
        "kB" | "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        u => {
            return Err(format!(
                "unknown unit {u:?} in {s:?} (B, KiB, MiB, GiB, TiB, kB, MB, GB, TB)"
            ));
        }
    };
    let out_of_range = || format!("{s:?} is out of range (below 2^64 bytes)");
    // Trailing zeros after the point change nothing; without them, 10^k below fits a `u128`.
    let frac = frac.trim_end_matches('0');
    let Some(scale) = u32::try_from(frac.len())
        .ok()
        .and_then(|k| 10u128.checked_pow(k))
    else {
        return Err(format!(
            "{s:?} has {} digits after the point (at most 38, trailing zeros not counted)",
            frac.len()
        ));
    };
    // whole.frac × mult = (whole × 10^k + frac) × mult / 10^k, in integers.
    let digits = format!("{whole}{frac}");
    let digits = digits.trim_start_matches('0');
    if digits.len() > 30 {
        return Err(out_of_range());
    }
    let n: u128 = if digits.is_empty() {
        0
    } else {
        digits.parse().map_err(|_| not_a_size())?
    };
    let scaled = n.checked_mul(mult).ok_or_else(out_of_range)?;
    if scaled % scale != 0 {
        return Err(format!(
            "{s:?} is not a whole number of bytes ({} and {}/{} bytes)",
            scaled / scale,
            (scaled % scale) / gcd(scaled % scale, scale),
            scale / gcd(scaled % scale, scale)
        ));
    }
    u64::try_from(scaled / scale)
        .ok()
        .filter(|&b| b != u64::MAX)
        .ok_or_else(out_of_range)
}

/// Greatest common divisor, for the fraction a refused size is named with.
fn gcd(a: u128, b: u128) -> u128 {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// The scope named on the command line: a group, or this user.
fn scope(group: Option<&str>) -> Result<QuotaScope, Box<dyn Error>> {
    Ok(match group {
        Some(g) => QuotaScope::group(g)?,
        None => QuotaScope::user(),
    })
}

/// `host` (host-memory channels: the all-zero UUID) or a GPU UUID.
fn one_device(s: &str) -> Result<Uuid, Box<dyn Error>> {
    if s.eq_ignore_ascii_case("host") {
        return Ok(Uuid([0; 16]));
    }
    Ok(s.parse::<Uuid>().map_err(|e| {
        format!("{s:?}: {e} (a GPU UUID as `nvidia-smi -L` prints it, `host`, or `all`)")
    })?)
}

/// The devices `--device` names: one, or `all` (every GPU the driver sees and every device of
/// this scope that already has a ledger).
fn devices(s: &str, scope: QuotaScope) -> Result<Vec<Uuid>, Box<dyn Error>> {
    if !s.eq_ignore_ascii_case("all") {
        return Ok(vec![one_device(s)?]);
    }
    let mut v: Vec<Uuid> = Vec::new();
    match cuda_ipc::probe::report() {
        Ok(rep) => v.extend(rep.devices.iter().map(|d| d.device.uuid())),
        Err(e) => eprintln!("cuda-ipc: `all` without the GPUs: {e}"),
    }
    for name in list_ledgers()? {
        if let Ok(l) = QuotaLedger::open_named(&name)
            && l.scope() == scope
            && !v.contains(&l.device())
        {
            v.push(l.device());
        }
    }
    if v.is_empty() {
        return Err("`--device all` found no GPU (no driver) and no ledger of this scope; name a GPU UUID or `host`".into());
    }
    Ok(v)
}

/// A device's name as shown: `host` for the all-zero UUID.
pub fn device_name(u: &Uuid) -> String {
    if u.0 == [0; 16] {
        "host".to_string()
    } else {
        u.to_string()
    }
}

/// `cuda-ipc quota set`.
pub fn run_set(device: &str, budget: u64, group: Option<&str>) -> Result<Outcome, Box<dyn Error>> {
    let scope = scope(group)?;
    for d in devices(device, scope)? {
        let l = QuotaLedger::set_budget(scope, d, budget)?;
        out!(
            "set budget for {scope} on {}: {} ({})",
            device_name(&d),
            if budget == UNLIMITED {
                "unlimited (reservations are counted, none is refused)".to_string()
            } else {
                format!("{}, {}", plural(budget, "byte"), bytes(budget))
            },
            l.name()
        );
    }
    Ok(Outcome::Ok)
}

/// `cuda-ipc quota remove`.
pub fn run_remove(device: &str, group: Option<&str>) -> Result<Outcome, Box<dyn Error>> {
    let scope = scope(group)?;
    for d in devices(device, scope)? {
        // What it holds goes uncounted from now on: said, not refused (the owner removes it).
        if let Ok(s) = QuotaLedger::open(scope, d).and_then(|l| l.snapshot())
            && !s.holders.is_empty()
        {
            out!(
                "note: {} reservations ({}) are forgotten with the ledger: their processes keep \
                 their memory, and a budget set again counts only what is reserved after it",
                s.holders.len(),
                bytes(s.used)
            );
        }
        // Also a ledger of another layout version (an older build's), which no open reads.
        let gone = QuotaLedger::remove_of(scope, d)?;
        out!(
            "{} {} ({scope} on {})",
            if gone { "removed" } else { "already gone:" },
            scope.segment_name(d),
            device_name(&d)
        );
    }
    Ok(Outcome::Ok)
}

/// A ledger of another user, left out as their channels are (`ls` lists only this user's).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Skipped {
    /// The segment's name.
    pub name: String,
    /// The uid that owns it.
    pub owner: u32,
    /// Whose it is and why it is left out, for people.
    pub note: String,
}

/// What [`collect_all`] found.
#[derive(Debug, Default)]
pub struct Ledgers {
    /// The ledgers read (dead holders reclaimed as they were read).
    pub snapshots: Vec<LedgerSnapshot>,
    /// Ledgers that could not be read, with why: problems (exit status 1).
    pub errors: Vec<(String, String)>,
    /// Other users' ledgers, left out: no problem.
    pub skipped: Vec<Skipped>,
}

/// The ledger `name` as a skipped one, when `e` says it is another user's (`open_named` refuses
/// another user's segment, and one of a group we are not in, with `ShmError::WrongOwner`; a file
/// planted under another user's ledger name with `QuotaError::Planted`); `None` for any other
/// error, which stays a problem.
pub fn skipped(name: &str, e: &cuda_ipc::Error) -> Option<Skipped> {
    match e {
        cuda_ipc::Error::Shm(cuda_ipc::ShmError::WrongOwner { owner, ours, .. }) => {
            Some(skipped_of(name, *owner, *ours))
        }
        // A file planted under another user's ledger name: theirs (and root's) to see to. Under
        // this user's name, or for root, it stays a problem that says what to do.
        cuda_ipc::Error::Quota(cuda_ipc::quota::QuotaError::Planted { uid, owner, .. }) => {
            let me = rustix::process::geteuid();
            (*uid != me.as_raw() && !me.is_root()).then(|| skipped_of(name, *owner, me.as_raw()))
        }
        _ => None,
    }
}

/// The ledger `name` of uid `owner` as a skipped one, for a process of uid `ours`: what
/// [`skipped`] makes of the error, and `gc` of the library's `Scan::skipped` entry of a ledger.
pub fn skipped_of(name: &str, owner: u32, ours: u32) -> Skipped {
    Skipped {
        name: name.to_string(),
        owner,
        note: format!(
            "skipped: it is {}'s, and this is {}; other users' budgets are theirs to see, as \
             their channels are",
            user_text(owner),
            user_text(ours)
        ),
    }
}

/// Every ledger in `/dev/shm`, inspected (dead holders reclaimed); those that cannot be read with
/// why, other users' apart. A creation abandoned half-way says so, and that `gc` removes it.
pub fn collect_all() -> Ledgers {
    collect_named(None)
}

/// [`collect_all`] of the ledger whose segment name is `only` (every ledger for `None`): what
/// `ls LEDGER` shows.
pub fn collect_named(only: Option<&str>) -> Ledgers {
    let mut l = Ledgers::default();
    let names = match list_ledgers() {
        Ok(n) => n,
        Err(e) => {
            l.errors.push(("/dev/shm".into(), e.to_string()));
            return l;
        }
    };
    for n in names.into_iter().filter(|n| only.is_none_or(|o| o == n)) {
        match QuotaLedger::open_named(&n).and_then(|q| q.snapshot()) {
            Ok(s) => l.snapshots.push(s),
            // Removed since it was listed: not a problem.
            Err(e) if cuda_ipc::cleanup::is_gone(&e) => {}
            Err(e) => match skipped(&n, &e) {
                Some(s) => l.skipped.push(s),
                None => {
                    let e = match cuda_ipc::quota::abandoned(&n) {
                        Ok(Some(why)) => format!("{e} ({why}: `cuda-ipc gc` removes it)"),
                        _ => e.to_string(),
                    };
                    l.errors.push((n, e));
                }
            },
        }
    }
    l
}

/// [`collect_all`] without the skipped ones: the ledgers read, and those that could not be.
pub fn collect() -> (Vec<LedgerSnapshot>, Vec<(String, String)>) {
    let l = collect_all();
    (l.snapshots, l.errors)
}

/// The lines saying which ledgers were skipped and why.
pub fn render_skipped(skipped: &[Skipped]) -> String {
    skipped
        .iter()
        .map(|s| format!("quota ledger {}: {}\n", s.name, s.note))
        .collect()
}

/// `used / budget` as shown.
pub fn used_of(s: &LedgerSnapshot) -> String {
    match s.budget {
        Some(b) => format!(
            "{} of {} used ({:.0}%)",
            bytes(s.used),
            bytes(b),
            if b == 0 {
                100.0
            } else {
                s.used as f64 * 100.0 / b as f64
            }
        ),
        None => format!("{} used, no limit", bytes(s.used)),
    }
}

/// The lines of the quota section of `ls` and `quota show`.
pub fn render(ledgers: &[LedgerSnapshot], errors: &[(String, String)]) -> String {
    let mut out = String::new();
    for s in ledgers {
        out.push_str(&format!(
            "quota {} on {}: {}, {} holders (ledger {}, mode {:o}, budget set by uid {})\n",
            s.scope,
            device_name(&s.device),
            used_of(s),
            s.holders.len(),
            s.name,
            s.mode,
            s.owner_uid
        ));
        for h in &s.holders {
            let left = h.left_in.as_ref().map_or(String::new(), |seg| {
                format!(
                    " (its memory stays in /dev/shm/{seg} until uid {}'s `cuda-ipc gc` removes \
                     it)",
                    h.uid
                )
            });
            out.push_str(&format!(
                "  pid {} (uid {}, pid ns {}) holds {}, {}{left}\n",
                h.identity.pid,
                h.uid,
                h.identity.pid_ns,
                bytes(h.bytes),
                crate::text::liveness(h.liveness)
            ));
        }
        if s.reclaimed > 0 {
            out.push_str(&format!(
                "  reclaimed {} entries of dead holders just now\n",
                s.reclaimed
            ));
        }
    }
    for (n, e) in errors {
        out.push_str(&format!("quota ledger {n}: cannot read: {e}\n"));
    }
    out
}

/// `cuda-ipc quota show [--json]`: other users' ledgers are skipped with a note (JSON:
/// `skipped`), no problem.
pub fn run_show(json: bool) -> Result<Outcome, Box<dyn Error>> {
    let Ledgers {
        snapshots: ledgers,
        errors,
        skipped,
    } = collect_all();
    if json {
        let v = serde_json::json!({
            "ledgers": ledgers,
            "errors": errors.iter().map(|(n, e)| serde_json::json!({"name": n, "error": e})).collect::<Vec<_>>(),
            "skipped": skipped,
        });
        out!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        if ledgers.is_empty() && errors.is_empty() {
            out!(
                "no quota budgets are set{} (`cuda-ipc quota set --device UUID|host|all --bytes SIZE`)",
                if skipped.is_empty() {
                    ""
                } else {
                    " for this user"
                }
            );
        } else {
            out_nonl!("{}", render(&ledgers, &errors));
        }
        out_nonl!("{}", render_skipped(&skipped));
    }
    Ok(if errors.is_empty() {
        Outcome::Ok
    } else {
        Outcome::Problems
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_as_people_write_them() {
        assert_eq!(parse_bytes("8GiB"), Ok(8 << 30));
        assert_eq!(parse_bytes("8G"), Ok(8 << 30));
        assert_eq!(parse_bytes("1.5 MiB"), Ok(3 << 19));
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("10kB"), Ok(10_000));
        assert_eq!(parse_bytes("unlimited"), Ok(UNLIMITED));
        assert!(
            parse_bytes("8 parsecs")
                .unwrap_err()
                .contains("unknown unit")
        );
        assert!(parse_bytes("GiB").is_err());
        assert!(parse_bytes("-1").unwrap_err().contains("negative"));
        assert!(parse_bytes("1e30").is_err());
        assert!(parse_bytes(".").is_err());
        assert!(parse_bytes("1.2.3").is_err());
        assert_eq!(parse_bytes("1.1kB"), Ok(1_100));
        assert_eq!(parse_bytes("0.5KiB"), Ok(512));
        assert_eq!(parse_bytes(".5K"), Ok(512));
        assert_eq!(parse_bytes("007"), Ok(7));
        assert_eq!(parse_bytes("0"), Ok(0));
        let e = parse_bytes("1.5").unwrap_err();
        assert!(
            e.contains("not a whole number of bytes (1 and 1/2 bytes)"),
            "{e}"
        );
        assert!(parse_bytes("0.3 KiB").unwrap_err().contains("whole number"));
        assert!(
            parse_bytes("18446744073709551616")
                .unwrap_err()
                .contains("out of range")
        );
        assert!(
            parse_bytes("99999999999TiB")
                .unwrap_err()
                .contains("out of range")
        );
        // Digits after the point: trailing zeros count for nothing, and a long tail is refused
        // with the reason (no overflow of the scale, no division by zero).
        assert_eq!(parse_bytes(&format!("0.{}", "0".repeat(200))), Ok(0));
        assert_eq!(parse_bytes(&format!("1.{} KiB", "0".repeat(40))), Ok(1024));
        let e = parse_bytes(&format!("0.{}1", "0".repeat(50))).unwrap_err();
        assert!(e.contains("51 digits after the point (at most 38"), "{e}");
    }

    #[test]
    fn devices_are_host_a_uuid_or_refused_with_the_forms_that_work() {
        assert_eq!(device_name(&one_device("host").unwrap()), "host");
        let u = one_device("GPU-12345678-1234-1234-1234-123456789abc").unwrap();
        assert_eq!(device_name(&u), "GPU-12345678-1234-1234-1234-123456789abc");
        let e = one_device("gpu0").unwrap_err().to_string();
        assert!(e.contains("`host`, or `all`"), "{e}");
    }

    #[test]
    fn only_another_users_ledger_is_skipped_and_the_note_names_both_users() {
        let e: cuda_ipc::Error = cuda_ipc::ShmError::WrongOwner {
            name: "cuda-ipc.quota.x".into(),
            owner: 0,
            ours: 4242,
        }
        .into();
        let s = skipped("cuda-ipc.quota.x", &e).unwrap();
        assert_eq!((s.name.as_str(), s.owner), ("cuda-ipc.quota.x", 0));
        assert!(s.note.starts_with("skipped: it is uid 0"), "{}", s.note);
        assert!(s.note.contains("this is uid 4242"), "{}", s.note);
        assert_eq!(
            render_skipped(std::slice::from_ref(&s)),
            format!("quota ledger cuda-ipc.quota.x: {}\n", s.note)
        );
        // Anything else stays a problem.
        let e: cuda_ipc::Error = cuda_ipc::ShmError::NotFound {
            name: "cuda-ipc.quota.x".into(),
        }
        .into();
        assert_eq!(skipped("cuda-ipc.quota.x", &e), None);
    }
}
