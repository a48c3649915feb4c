//! A producer that reserves its pool from the device's shared budget (`ChannelOptions::quota`),
//! holds it, and says whether it got it: run two of them against a budget that fits one pool and
//! the second is refused with `OverQuota` naming the first and its bytes; kill the first and the
//! second's next try gets the bytes.
//!
//! ```text
//! cuda-ipc quota set --device host --bytes 1MiB      # or --device GPU-... for a GPU pool
//! cargo run -p cuda-ipc-examples --example 09_quota -- --host --hold 30 &   # created ...
//! cargo run -p cuda-ipc-examples --example 09_quota -- --host --hold 0      # refused: ...
//! ```
//! Flags: `[--host] [--buffers 2] [--bytes 393216] [--hold 30] [--name NAME]`. The default pool,
//! 2 buffers of 384 KiB (768 KiB), fits a 1 MiB budget once: the second producer would need
//! 1.5 MiB in all and is refused.
//!
//! Prints `created NAME: reserved B bytes` and holds the pool for `--hold` seconds (then closes
//! it), or prints `refused: ...` and exits with status 3 when the budget is spent. `--host` uses a
//! host-memory pool (no GPU); without it the pool is device memory of the default GPU.

mod common;

use common::Res;
use common::args::Argv;
use cuda_ipc::channel::{ChannelOptions, Producer};
use cuda_ipc::driver::Context;
use cuda_ipc::quota::{QuotaError, QuotaScope};
use std::time::Duration;

fn main() {
    match run() {
        Ok(()) => {}
        Err(e) => {
            let over = matches!(
                e.downcast_ref::<cuda_ipc::Error>(),
                Some(cuda_ipc::Error::Quota(QuotaError::OverQuota { .. }))
            );
            if over {
                println!("refused: {e}");
                std::process::exit(3);
            }
            eprintln!("09_quota: {e}");
            std::process::exit(1);
        }
    }
}

fn run() -> Res<()> {
    let mut args = Argv::from_env();
    let (mut host, mut buffers, mut bytes, mut hold) = (false, 2usize, 384usize << 10, 30u64);
    let mut name = format!("quota-demo-{}", std::process::id());
    while let Some(k) = args.flag() {
        match k.as_str() {
            "--host" => host = true,
            "--buffers" => buffers = args.parse(&k)?,
            "--bytes" => bytes = args.parse(&k)?,
            "--hold" => hold = args.parse(&k)?,
            "--name" => name = args.value(&k)?,
            other => return Err(format!("unknown argument {other:?}").into()),
        }
    }
    let opts = ChannelOptions::new(bytes)
        .buffers(buffers)
        .quota(QuotaScope::user());
    let tx = if host {
        Producer::create_host(&name, &opts)?
    } else {
        Producer::create(&Context::default_device()?, &name, &opts)?
    };
    println!("created {name}: reserved {} bytes", buffers * bytes);
    std::thread::sleep(Duration::from_secs(hold));
    tx.close(Duration::from_secs(1))?;
    Ok(())
}
