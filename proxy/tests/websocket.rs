//! WebSocket proxying against a real WebSocket server and client (the
//! Python `websockets` package, installed by `.ci/run`): messages both ways,
//! the `max_upgraded` cap, the idle deadline of a tunnel, and an upgrade the
//! upstream refuses, after which nothing the client sent is read as a
//! request (the CVE-2026-2833 class).

#![allow(clippy::unwrap_used)]
mod common;
use common::*;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/py/ws_echo.py");

/// The echo server, killed by its PID when dropped.
struct WsServer {
    child: Child,
    port: u16,
}

impl WsServer {
    fn start() -> WsServer {
        let mut child = Command::new("python3")
            .args([SCRIPT, "server"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("python3 ({e}): run `bash .ci/run`, which sets it up"));
        let mut line = String::new();
        let out = child.stdout.take().unwrap();
        BufReader::new(out).read_line(&mut line).unwrap();
        let port = line.trim().parse().unwrap_or_else(|_| {
            let _ = child.kill();
            panic!("the echo server did not start (is `websockets` installed? `bash .ci/run`): {line:?}")
        });
        WsServer { child, port }
    }
}

impl Drop for WsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn edge(ws: &WsServer, limits: &str) -> (Origin, Ultrafast) {
    let a = Origin::start("a");
    let uf = Ultrafast::start(&format!(
        "[limits]\n{limits}\n{}[pools.ws]\nmembers = [{{ addr = \"127.0.0.1:{}\" }}]\n\n\
         [[routes]]\npath = \"/ws\"\npool = \"ws\"\n\n[[routes]]\npath = \"/\"\npool = \"a\"\n",
        pool_toml("a", &[&a], ""),
        ws.port
    ));
    (a, uf)
}

const HANDSHAKE: &[u8] =
    b"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n";

/// A raw upgrade through the edge: the connection and the status.
fn raw_upgrade(uf: &Ultrafast) -> (Client, u16) {
    let mut c = Client::connect(uf.addr).unwrap();
    c.send_raw(HANDSHAKE).unwrap();
    let r = c.read_response(true).unwrap();
    (c, r.status)
}

#[test]
fn messages_pass_both_ways_through_the_edge() {
    let ws = WsServer::start();
    let (_a, uf) = edge(&ws, "");
    let url = format!("ws://{}/ws", uf.addr);
    let out = Command::new("python3")
        .args([SCRIPT, "client", &url, "40"])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && said.trim() == "ok 40 1000",
        "{said} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(uf.metric("ultrafast_upgrades_total", &["upgraded"]), 1.0);
    assert!(eventually(Duration::from_secs(5), || {
        uf.metric("ultrafast_upgraded_connections", &[]) == 0.0
    }));
}

#[test]
fn upgrades_are_capped_and_an_idle_tunnel_is_closed() {
    let ws = WsServer::start();
    let (_a, uf) = edge(&ws, "max_upgraded = 2\nupgraded_idle_timeout_s = 1");
    let (mut one, s1) = raw_upgrade(&uf);
    let (mut two, s2) = raw_upgrade(&uf);
    assert_eq!((s1, s2), (101, 101));
    assert_eq!(uf.metric("ultrafast_upgraded_connections", &[]), 2.0);
    let (_three, s3) = raw_upgrade(&uf);
    assert_eq!(s3, 503, "past max_upgraded");
    assert_eq!(uf.metric("ultrafast_upgrades_total", &["refused_cap"]), 1.0);
    // Without `Connection: upgrade` Pingora still tunnels it: the same cap.
    let mut four = Client::connect(uf.addr).unwrap();
    four.send_raw(
        b"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n\
Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n",
    )
    .unwrap();
    assert_eq!(
        four.read_response(true).unwrap().status,
        503,
        "no Connection token, capped too"
    );
    assert_eq!(uf.metric("ultrafast_upgrades_total", &["refused_cap"]), 2.0);
    // Silent for the idle deadline (1 s): closed, and the slots come back.
    let t = std::time::Instant::now();
    assert!(one.closed_within(Duration::from_secs(5)));
    assert!(two.closed_within(Duration::from_secs(5)));
    assert!(
        t.elapsed() >= Duration::from_millis(700),
        "{:?}",
        t.elapsed()
    );
    assert!(eventually(Duration::from_secs(3), || {
        uf.metric("ultrafast_upgraded_connections", &[]) == 0.0
    }));
    let (_again, s) = raw_upgrade(&uf);
    assert_eq!(s, 101, "a slot came back");
}

#[test]
fn a_refused_upgrade_closes_so_nothing_behind_it_is_read() {
    let ws = WsServer::start();
    let (a, uf) = edge(&ws, "");
    // The origin at `/` answers an upgrade with a plain 200. What the client
    // sent behind its request (here a whole request) was for the tunnel.
    let mut c = Client::connect(uf.addr).unwrap();
    let mut raw = b"GET /x HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
        .to_vec();
    raw.extend_from_slice(b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n");
    c.send_raw(&raw).unwrap();
    let r = c.read_response(false).unwrap();
    assert_eq!(r.status, 200);
    assert!(
        c.closed_within(Duration::from_secs(3)),
        "kept open after a refused upgrade"
    );
    assert_eq!(
        a.order(),
        vec!["/x".to_string()],
        "a request behind the refused upgrade was read"
    );
    assert_eq!(
        uf.metric("ultrafast_upgrades_total", &["refused_upstream"]),
        1.0
    );
}
