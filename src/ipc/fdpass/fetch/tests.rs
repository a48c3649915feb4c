//! The socket transport against a scripted server in a child process (this test binary run
//! again with [`SCRIPT`] set): a server that closes connections unanswered, as the real one
//! does with a client whose request is late by more than its 1 s receive timeout.

use super::*;
use crate::ipc::fdpass::socket::socket_path;
use crate::ipc::fdpass::tests::content;
use crate::ipc::fdpass::wire::{ENTRY_OK, REQUEST_OK, decode_request, encode_reply};
use rustix::net::{AddressFamily, RecvFlags, SendFlags, SocketAddrUnix, SocketFlags, SocketType};
use std::io::{BufRead, BufReader, Read, Write};
use std::mem::MaybeUninit;
use std::process::{Child, Command, Stdio};

/// Set in the child: "CLOSE TOTAL", close the first CLOSE connections after reading their
/// request, answer the rest, stop after TOTAL connections.
const SCRIPT: &str = "CUDA_IPC_TEST_SCRIPTED_FD_SERVER";

/// The child's part: serves as scripted, then waits for its stdin to close, removes its
/// socket file and returns.
fn scripted_server(script: &str) {
    let mut words = script.split(' ').map(|w| w.parse::<usize>().unwrap());
    let (close, total) = (words.next().unwrap(), words.next().unwrap());
    let me = ProcessIdentity::current().unwrap();
    let path = socket_path(&me);
    let listener = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )
    .unwrap();
    rustix::net::bind(&listener, &SocketAddrUnix::new(path.as_str()).unwrap()).unwrap();
    rustix::fs::chmod(path.as_str(), rustix::fs::Mode::from_raw_mode(0o600)).unwrap();
    rustix::net::listen(&listener, 8).unwrap();
    let [a, b, c, d] = me.to_words();
    println!("@@ identity {a} {b} {c} {d}");
    std::io::stdout().flush().unwrap();
    for n in 0..total {
        let conn = rustix::net::accept_with(&listener, SocketFlags::CLOEXEC).unwrap();
        let mut buf = vec![0u8; 8192];
        let got = rustix::net::recv(&conn, &mut buf, RecvFlags::empty())
            .unwrap()
            .0;
        let ids = decode_request(&buf[..got]).unwrap();
        if n >= close {
            let fd = rustix::fs::memfd_create("scripted", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
            let mut f = std::fs::File::from(fd);
            f.write_all(format!("answered on connection {}", n + 1).as_bytes())
                .unwrap();
            let fd = OwnedFd::from(f);
            let entries: Vec<(u32, u32)> = ids.iter().map(|id| (*id, ENTRY_OK)).collect();
            let fds = vec![std::os::fd::AsFd::as_fd(&fd); ids.len()];
            let bytes = encode_reply(REQUEST_OK, &entries);
            let mut space =
                vec![MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(fds.len()))];
            let mut control = rustix::net::SendAncillaryBuffer::new(&mut space);
            assert!(control.push(rustix::net::SendAncillaryMessage::ScmRights(&fds)));
            rustix::net::sendmsg(
                &conn,
                &[std::io::IoSlice::new(&bytes)],
                &mut control,
                SendFlags::NOSIGNAL,
            )
            .unwrap();
        }
        drop(conn);
        println!("@@ served {}", n + 1);
        std::io::stdout().flush().unwrap();
    }
    let mut rest = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut rest);
    let _ = rustix::fs::unlink(path.as_str());
}

/// Starts the scripted server (test `name` of this binary) and returns it with its identity.
fn start(
    name: &str,
    close: usize,
    total: usize,
) -> (Child, BufReader<std::process::ChildStdout>, ProcessIdentity) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            &format!("ipc::fdpass::fetch::tests::{name}"),
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(SCRIPT, format!("{close} {total}"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    let identity = loop {
        line.clear();
        if !matches!(out.read_line(&mut line), Ok(n) if n > 0) {
            break None;
        }
        // The harness writes the test's name first, on the same line.
        if let Some((_, words)) = line.trim().split_once("@@ identity ") {
            let w: Vec<u64> = words.split(' ').filter_map(|w| w.parse().ok()).collect();
            break <[u64; 4]>::try_from(w)
                .ok()
                .map(ProcessIdentity::from_words);
        }
    };
    match identity {
        Some(id) => (child, out, id),
        None => {
            let _ = child.kill();
            let status = child.wait();
            panic!("the scripted server did not start: {status:?}, {line:?}");
        }
    }
}

/// Lets the child finish and returns the count of connections it served.
fn finish(mut child: Child, mut out: BufReader<std::process::ChildStdout>) -> usize {
    drop(child.stdin.take());
    let mut rest = String::new();
    out.read_to_string(&mut rest).unwrap();
    assert!(child.wait().unwrap().success(), "{rest}");
    rest.lines()
        .filter_map(|l| l.strip_prefix("@@ served "))
        .map(|n| n.parse::<usize>().unwrap())
        .max()
        .unwrap_or(0)
}

#[test]
fn a_connection_closed_unanswered_is_asked_again_over_a_new_one() {
    if let Ok(script) = std::env::var(SCRIPT) {
        return scripted_server(&script);
    }
    let name = "a_connection_closed_unanswered_is_asked_again_over_a_new_one";
    let (child, out, exporter) = start(name, UNANSWERED_TRIES - 1, UNANSWERED_TRIES);
    let fds = fetch_many(
        &exporter,
        &[(7, -1), (8, -1)],
        FdTransport::Socket,
        Duration::from_secs(10),
    )
    .unwrap();
    let texts: Vec<String> = fds.into_iter().map(content).collect();
    let last = format!("answered on connection {UNANSWERED_TRIES}");
    assert_eq!(texts, [last.clone(), last]);
    assert_eq!(finish(child, out), UNANSWERED_TRIES);
}

#[test]
fn a_server_that_keeps_closing_unanswered_is_an_error_after_a_few_tries() {
    if let Ok(script) = std::env::var(SCRIPT) {
        return scripted_server(&script);
    }
    let name = "a_server_that_keeps_closing_unanswered_is_an_error_after_a_few_tries";
    let (child, out, exporter) = start(name, UNANSWERED_TRIES, UNANSWERED_TRIES);
    let t = Instant::now();
    let e = fetch(
        &exporter,
        7,
        -1,
        FdTransport::Socket,
        Duration::from_secs(10),
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("closed the connection before answering every id"),
        "{e}"
    );
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    assert_eq!(finish(child, out), UNANSWERED_TRIES, "one connection a try");
}
