//! `cuda-ipc`: see whether this machine can share CUDA memory between processes, what registries
//! and channels exist in `/dev/shm`, and clean up what dead processes left.
//!
//! Everything here goes through the `cuda-ipc` library: the probe (`doctor`), the read-only
//! inspection of registries and channels (`ls`, `watch`, `metrics`), the quota ledgers (`quota`),
//! and the library's cleanup scan and removal (`gc`, over `cuda_ipc::cleanup`). GPU state comes
//! from NVML (`nvml-wrapper`, loaded at run time), only in this tool.

/// `println!` that ends the process quietly (status 141) when stdout's reader went away
/// (`cuda-ipc ls | head`) instead of panicking, and with status 1 on other write errors.
macro_rules! out {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        if let Err(e) = writeln!(std::io::stdout().lock(), $($t)*) {
            $crate::stdout_failed(e);
        }
    }};
}

/// `print!` with the same handling as [`out!`].
macro_rules! out_nonl {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let mut o = std::io::stdout().lock();
        if let Err(e) = write!(o, $($t)*).and_then(|()| o.flush()) {
            $crate::stdout_failed(e);
        }
    }};
}

/// Ends the process after a failed write to stdout: quietly with status 141 (128 + SIGPIPE, what a
/// shell reports for a program killed by the signal) when the reader closed the pipe, else with the
/// error and status 1.
fn stdout_failed(e: std::io::Error) -> ! {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        std::process::exit(141);
    }
    eprintln!("cuda-ipc: writing to stdout: {e}");
    std::process::exit(1);
}

mod bridge;
mod doctor;
mod gc;
mod gpu;
mod hold;
mod latency;
mod listing;
mod ls;
mod metrics;
mod names;
mod others;
mod quota;
mod state;
mod text;
mod tui;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

/// The exit statuses, printed after every command's help ([`EXIT_STATUS`]).
macro_rules! exit_status {
    () => {
        "\
Exit status:
  0  ok
  1  problems found (doctor: something sharing needs is missing; ls, watch: leftovers of dead
     processes, a segment that cannot be read, or NAME not found; gc: something could not be read
     or removed, or NAME not found; another user's object, named or not, is passed over with a
     note, no problem), or an error
  2  usage error (an unknown option, a NAME that no segment can bear: empty, `..`, with a `/`
     but that of /dev/shm/FILE, too long)
  141  the reader of stdout went away (as `| head` does); nothing else is wrong"
    };
}

const EXIT_STATUS: &str = exit_status!();

/// The rule for a NAME of `ls`, `watch`, `metrics` and `gc` (`names`), then the exit statuses:
/// printed after their help.
const NAME_AND_EXIT_STATUS: &str = concat!(
    "\
NAME:
  An object's own name, as its program gave it, never read for a prefix: `ls foo` shows the
  registry, channel and tensor set named foo, and the quota ledger of that name (a ledger's only
  name is its segment name, cuda-ipc.quota.u<uid>.<device>); `ls cuda-ipc.ch.foo` shows those
  named cuda-ipc.ch.foo (that channel's segment is /dev/shm/cuda-ipc.ch.cuda-ipc.ch.foo), never
  channel foo.
  A file in /dev/shm is given as its path, /dev/shm/FILE (as ls and gc print it), and names the
  one object it belongs to: the registry it holds; else, by its prefix, channel X for
  cuda-ipc.ch.X or cuda-ipc.hp.X, tensor set X for cuda-ipc.ts.X, .tg.X, .td.X or .th.X, the
  quota ledger cuda-ipc.quota.*; else the registry named FILE. A process's own file
  (cuda-ipc.live.*, .fd.*, .br.*) is refused, saying what it is.

",
    exit_status!()
);

#[cfg(feature = "remote")]
const EXIT_STATUS_BRIDGE: &str = "\
Exit status:
  0  the near channel was closed and everything was carried
  1  an error (NIXL not found, wrong secret, ...)
  3  recv: the lane was lost; the channel's consumers see the producer gone";

/// Tools for cuda-ipc: check the machine, list and watch registries and channels, export metrics,
/// set quota budgets, clean up.
#[derive(Parser, Debug)]
#[command(name = "cuda-ipc", version, after_help = EXIT_STATUS)]
struct Cli {
    /// More log output on stderr (-v: info, -vv: debug, -vvv: trace).
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Check the driver, each GPU, WSL, /dev/shm and the ptrace rules, with the fix for what is
    /// missing.
    #[command(after_help = EXIT_STATUS)]
    Doctor {
        /// Print one JSON document (docs/cli.md) instead of lines.
        #[arg(long)]
        json: bool,
    },
    /// List registries, channels, tensor sets and quota ledgers in /dev/shm: records, sequence
    /// numbers, generations, owners and whether they are alive, sizes, consumers and readers with
    /// their holds and cursors. Other users' objects are not listed: a line per uid counts them,
    /// as `gc` skips them.
    #[command(after_help = NAME_AND_EXIT_STATUS)]
    Ls {
        /// Only the registry, channel, tensor set and quota ledger (its budget and holders) named
        /// NAME, never read for a prefix; or the object of the file /dev/shm/FILE (below).
        #[arg(value_parser = name_arg)]
        name: Option<String>,
        /// Print JSON instead of tables (docs/cli.md).
        #[arg(long)]
        json: bool,
    },
    /// Like `ls`, refreshed every interval, with rates (publishes/s, frames/s, received/s). On a
    /// terminal: a live view (frames/s and lag sparklines, GPU bars through NVML, quota budgets,
    /// the latency histogram; q quits); with `--plain` or when stdout is not a terminal, lines.
    #[command(after_help = NAME_AND_EXIT_STATUS)]
    Watch {
        /// Only the registry, channel and tensor set named NAME, or the object of the file
        /// /dev/shm/FILE, as for `ls` (below).
        #[arg(value_parser = name_arg)]
        name: Option<String>,
        /// Time between refreshes, in milliseconds.
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(10..))]
        interval: u64,
        /// Stop after this many refreshes, at least 1 (default: until interrupted).
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
        count: Option<u64>,
        /// Print one JSON object per refresh, one per line (JSON Lines): each the document `ls
        /// --json` prints (docs/cli.md), with the rates.
        #[arg(long)]
        json: bool,
        /// Print the refreshed tables as lines (for scripts), even on a terminal.
        #[arg(long, conflicts_with = "json")]
        plain: bool,
    },
    /// Serve the channels' counters, latency histograms, GPU state (NVML) and quota budgets in
    /// the OpenMetrics text format on GET /metrics, until killed. A NAME that names nothing now
    /// (nothing of that name, or nothing that can be read: a FIFO, a file that is no registry) is
    /// said once on stderr at the start, and served on: it may appear later. A NAME that `ls`
    /// refuses (a process's own file) is refused, exit status 1.
    #[command(after_help = NAME_AND_EXIT_STATUS)]
    Metrics {
        /// Address to listen on (IP:PORT; port 0 picks a free one, printed on start).
        #[arg(long, default_value = metrics::DEFAULT_LISTEN)]
        listen: String,
        /// Only the registry, channel and tensor set named NAME, or the object of the file
        /// /dev/shm/FILE, as for `ls` (below).
        #[arg(value_parser = name_arg)]
        name: Option<String>,
        /// Connections served at once; more are answered 503 and closed at once.
        #[arg(long, default_value_t = metrics::server::Limits::DEFAULT.max_connections as u64,
              value_parser = clap::value_parser!(u64).range(1..=65536))]
        max_connections: u64,
        /// Milliseconds a client has, from connecting, to send its request; then it is closed.
        #[arg(long, default_value_t = metrics::server::Limits::DEFAULT.read_timeout.as_millis() as u64,
              value_parser = clap::value_parser!(u64).range(1..))]
        read_timeout_ms: u64,
        /// Milliseconds a client has to take a response once it is ready; then it is closed.
        #[arg(long, default_value_t = metrics::server::Limits::DEFAULT.write_timeout.as_millis() as u64,
              value_parser = clap::value_parser!(u64).range(1..))]
        write_timeout_ms: u64,
    },
    /// Per-device budgets across processes: producers that opt in
    /// (`ChannelOptions::quota`) reserve their pool from them. Advisory: memory allocated outside
    /// cuda-ipc is not counted.
    #[command(subcommand, after_help = EXIT_STATUS)]
    Quota(QuotaCommand),
    /// The remote lane over NVIDIA NIXL: carry a channel's frames to a channel on another host
    /// (`send` on the producer's host, `recv` on the consumers'). Needs NIXL's libraries
    /// (`pip install --no-deps nixl-cu13`, its library folder on LD_LIBRARY_PATH).
    #[cfg(feature = "remote")]
    #[command(subcommand, after_help = EXIT_STATUS_BRIDGE)]
    Bridge(bridge::BridgeCommand),
    /// Keep a VMM tensor set attachable after its writer dies: hold its file descriptors (which
    /// pins its device memory) and serve them to new readers, until SIGINT or SIGTERM, or until
    /// the set is closed by its writer or replaced (exit status 0, with a line saying why).
    #[command(after_help = EXIT_STATUS)]
    Hold {
        /// The tensor set: its own name, never read for a prefix (`cuda-ipc.ts.foo` is the set
        /// of that name), or /dev/shm/FILE of one of its files (/dev/shm/cuda-ipc.ts.NAME, .tg.,
        /// .td., .th.).
        #[arg(value_parser = set_name_arg)]
        name: String,
    },
    /// Remove what dead processes left: registry records and participant entries of dead
    /// processes, segments of channels whose producer died, consumer slots and holds of dead
    /// consumers, tensor sets whose writer died (unless a live holder serves a VMM set), dead
    /// holders' quota reservations, and registries, channels, tensor sets and quota ledgers whose
    /// creation was abandoned half-way (one that may still finish, younger than 2 s or its
    /// creator running, is kept with a line saying why; a registry's only when it has the
    /// registry magic and its recorded creator is dead: a registry's name is anyone's, so a file
    /// under it without the magic, empty, sparse or zero there, as another program's segment
    /// may be, is never removed, named or not: `gc NAME` says `not a cuda-ipc registry: no magic
    /// (...); left as it is`, a problem); without a NAME also the liveness files
    /// (one younger than 5 s is kept, with a line saying why), fd server sockets and bridge
    /// status files of killed processes. Never touches what a live process owns, nor another
    /// user's segments (nor, but for root, the liveness files, fd server sockets and bridge status
    /// files another user's killed processes left; nor, by anyone, what stands under a liveness
    /// file's name but is no liveness file, an empty file of mode 0644, which is a problem): it
    /// says what it passed over, a line per uid (another user's quota ledger a line of its own),
    /// no problem, whether NAME names it or not. A live reader of a dead writer's set keeps what
    /// it mapped (the files are unlinked, not shrunk).
    #[command(after_help = NAME_AND_EXIT_STATUS)]
    Gc {
        /// Only the registry, channel, tensor set and quota ledger
        /// (`cuda-ipc.quota.u<uid>.<device>` or `cuda-ipc.quota.g<gid>.<device>`) named NAME,
        /// never read for a prefix; or the object of the file /dev/shm/FILE, as for `ls` (below).
        #[arg(value_parser = name_arg)]
        name: Option<String>,
        /// Only say what would be removed.
        #[arg(long)]
        dry_run: bool,
        /// Print one JSON document (docs/cli.md) instead of lines.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand, Debug)]
enum QuotaCommand {
    /// Set (or create) the budget of a device, for this user or a group. Only the ledger's owner
    /// may change it (root removes another user's ledger by hand: `rm /dev/shm/NAME`).
    Set {
        /// A GPU UUID (`nvidia-smi -L`), `host` (host-memory channels), or `all` (every GPU the
        /// driver sees and every device that has a budget).
        #[arg(long)]
        device: String,
        /// The budget: 8GiB, 512MiB, 1.5G, 4096, 10GB, or `unlimited`.
        #[arg(long, value_parser = quota::parse_bytes, allow_hyphen_values = true)]
        bytes: u64,
        /// The group whose budget it is (mode 0660); default: this user's (mode 0600).
        #[arg(long)]
        group: Option<String>,
    },
    /// Show every budget: used, budget, holders (dead ones reclaimed first).
    Show {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Remove a budget (its ledger segment); producers then find none.
    Remove {
        /// A GPU UUID, `host`, or `all`.
        #[arg(long)]
        device: String,
        /// The group whose budget it is; default: this user's.
        #[arg(long)]
        group: Option<String>,
    },
}

/// A NAME of `ls`, `watch`, `metrics` or `gc`: an object's own name or `/dev/shm/FILE`
/// ([`names`]), each a segment name or one's part by the library's rule
/// ([`cuda_ipc::raw::shm::validate_name`]); one that breaks it names nothing: a usage error (exit
/// status 2), said as clap says any invalid argument.
fn name_arg(name: &str) -> Result<String, String> {
    names::validate(name).map(|()| name.to_string())
}

/// The NAME of `hold`: the tensor set's own name, or `/dev/shm/FILE` of one of its files
/// ([`names::set_of`]); the set's name, by the library's rule for those
/// ([`cuda_ipc::tensorset::validate_set_name`]).
fn set_name_arg(name: &str) -> Result<String, String> {
    names::set_of(name).map(str::to_string)
}

fn init_logging(verbose: u8) {
    let level = match verbose {
        0 => tracing_subscriber::filter::LevelFilter::WARN,
        1 => tracing_subscriber::filter::LevelFilter::INFO,
        2 => tracing_subscriber::filter::LevelFilter::DEBUG,
        _ => tracing_subscriber::filter::LevelFilter::TRACE,
    };
    tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(std::io::stderr)
        .with_target(false)
        .init();
}

/// What a subcommand found: `Ok` with no problems, `Problems` when it ran but found some.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Nothing wrong.
    Ok,
    /// It ran and found problems (exit status 1).
    Problems,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // A bridge logs what it does (the peer, the transport UCX chose) at info level.
    #[cfg(feature = "remote")]
    let verbose = if matches!(cli.command, Command::Bridge(_)) {
        cli.verbose.max(1)
    } else {
        cli.verbose
    };
    #[cfg(not(feature = "remote"))]
    let verbose = cli.verbose;
    init_logging(verbose);
    let r = match cli.command {
        Command::Doctor { json } => doctor::run(json),
        Command::Ls { name, json } => ls::run_ls(name.as_deref(), json),
        Command::Watch {
            name,
            interval,
            count,
            json,
            plain,
        } => ls::run_watch(name.as_deref(), interval, count, json, plain),
        Command::Metrics {
            listen,
            name,
            max_connections,
            read_timeout_ms,
            write_timeout_ms,
        } => metrics::run(
            &listen,
            name.as_deref(),
            metrics::server::Limits {
                max_connections: max_connections as usize,
                read_timeout: std::time::Duration::from_millis(read_timeout_ms),
                write_timeout: std::time::Duration::from_millis(write_timeout_ms),
                ..metrics::server::Limits::DEFAULT
            },
        ),
        Command::Quota(QuotaCommand::Set {
            device,
            bytes,
            group,
        }) => quota::run_set(&device, bytes, group.as_deref()),
        Command::Quota(QuotaCommand::Show { json }) => quota::run_show(json),
        Command::Quota(QuotaCommand::Remove { device, group }) => {
            quota::run_remove(&device, group.as_deref())
        }
        Command::Gc {
            name,
            dry_run,
            json,
        } => gc::run(name.as_deref(), dry_run, json),
        Command::Hold { name } => hold::run(&name),
        #[cfg(feature = "remote")]
        Command::Bridge(b) => bridge::run(b),
    };
    match r {
        Ok(Outcome::Ok) => ExitCode::SUCCESS,
        Ok(Outcome::Problems) => ExitCode::from(1),
        Err(e) => {
            eprintln!("cuda-ipc: {e}");
            ExitCode::from(1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    /// `--chunk-mib` whose bytes do not count in a `u64` is refused with the bound, never cut to
    /// another size (2^44 MiB shifted to bytes is 0: one-byte WRITEs).
    #[cfg(feature = "remote")]
    #[test]
    fn a_chunk_past_u64_bytes_is_refused_with_the_bound() {
        use clap::Parser as _;
        let args = |mib: u64| {
            Cli::try_parse_from([
                "cuda-ipc",
                "bridge",
                "send",
                "--tensorset",
                "s",
                "--connect",
                "127.0.0.1:1",
                "--secret-env",
                "S",
                "--chunk-mib",
                &mib.to_string(),
            ])
        };
        let most = bridge::MAX_CHUNK_MIB;
        assert_eq!(most << 20 >> 20, most);
        assert!(args(most).is_ok());
        let e = args(most + 1).unwrap_err().to_string();
        assert!(
            e.contains(&(most + 1).to_string()) && e.contains(&most.to_string()),
            "{e}"
        );
    }
}
