//! HTTP/2's published attacks against an h2c listener, each from raw
//! frames (`py/h2_attack.py`): rapid reset (CVE-2023-44487), a
//! CONTINUATION flood (CVE-2024-27316 class), an HPACK bomb, SETTINGS and
//! PING floods, a zero-window stall and stream-limit abuse. During each,
//! a normal client keeps being served (HTTP/1.1 and HTTP/2), the server's
//! memory stays under the bound the README's Security section states
//! (64 MiB over its idle size), and nothing panics.

#![allow(clippy::unwrap_used)]
mod common;
use common::*;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The bound on what one attacking connection may add to the server.
const RSS_BOUND_KIB: u64 = 64 * 1024;

fn attack(name: &str, port: u16, seconds: f64, extra: &[&str]) -> serde_json::Value {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/py/h2_attack.py");
    let out = Command::new("timeout")
        .arg("60")
        .arg("python3")
        .arg(script)
        .arg(name)
        .args([
            "--port",
            &port.to_string(),
            "--seconds",
            &seconds.to_string(),
        ])
        .args(extra)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    serde_json::from_str(&text).unwrap_or_else(|e| {
        panic!(
            "h2_attack {name}: {e}\n{text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// Requests of a normal client (HTTP/1.1, then HTTP/2 on its own
/// connection) while `busy` holds: (answered, failed).
fn normal_client(uf_addr: std::net::SocketAddr, busy: Arc<AtomicBool>) -> (usize, usize) {
    let (ok, bad) = (AtomicUsize::new(0), AtomicUsize::new(0));
    let mut n = 0;
    while busy.load(Ordering::Relaxed) && n < 2000 {
        n += 1;
        let r = Client::connect(uf_addr).and_then(|mut c| c.request("GET", "/ok", &[], b""));
        match r {
            Ok(r) if r.status == 200 => ok.fetch_add(1, Ordering::Relaxed),
            _ => bad.fetch_add(1, Ordering::Relaxed),
        };
        let req = http::Request::get(format!("http://{uf_addr}/ok"))
            .body(())
            .unwrap();
        match h2c(uf_addr.port(), req, true).status {
            200 => ok.fetch_add(1, Ordering::Relaxed),
            _ => bad.fetch_add(1, Ordering::Relaxed),
        };
        std::thread::sleep(Duration::from_millis(50));
    }
    (ok.into_inner(), bad.into_inner())
}

#[test]
fn http2_attacks_leave_normal_clients_served_and_memory_bounded() {
    let origin = Origin::start("o");
    // The generated listener is plain HTTP/1.1: h2c beside it.
    let h2c_port = free_port();
    let mut uf = Ultrafast::start(&format!(
        "[[listeners]]\nname = \"h2c\"\naddress = \"127.0.0.1:{h2c_port}\"\nh2c = true\n\n\
         [[routes]]\npath = \"/\"\npool = \"o\"\n\n{}",
        pool_toml("o", &[&origin], "")
    ));
    let h2c_addr: std::net::SocketAddr = format!("127.0.0.1:{h2c_port}").parse().unwrap();
    let idle = uf.rss_kib();
    let cases: [(&str, &[&str]); 7] = [
        ("rapid-reset", &["--count", "50000"]),
        ("continuation", &["--count", "20000"]),
        ("hpack-bomb", &["--count", "5000"]),
        ("settings-flood", &["--count", "200000"]),
        ("ping-flood", &["--count", "500000"]),
        ("zero-window", &["--count", "100", "--path", "/big/1000000"]),
        ("streams", &["--count", "1000"]),
    ];
    for (name, extra) in cases {
        let busy = Arc::new(AtomicBool::new(true));
        let client = std::thread::spawn({
            let busy = busy.clone();
            move || normal_client(h2c_addr, busy)
        });
        let (v, peak) = peak_rss(uf.child.id(), || attack(name, h2c_port, 3.0, extra));
        busy.store(false, Ordering::Relaxed);
        let (ok, bad) = client.join().unwrap();
        eprintln!("{name}: {v} rss {idle} -> {peak} KiB, normal {ok} ok {bad} failed");
        assert!(
            ok >= 4 && bad == 0,
            "{name}: a normal client got {ok} answers, {bad} failures: {v}"
        );
        assert!(
            peak < idle + RSS_BOUND_KIB,
            "{name}: RSS {idle} KiB idle, {peak} KiB under attack"
        );
        assert!(
            uf.child.try_wait().unwrap().is_none(),
            "{name}: the server exited"
        );
    }
    // The attacks that cannot be served are cut: rapid reset and the
    // CONTINUATION flood end with a GOAWAY or a closed connection.
    for name in ["rapid-reset", "continuation"] {
        let v = attack(name, h2c_port, 2.0, &["--count", "50000"]);
        assert!(
            v["closed"] == true || !v["goaway"].is_null(),
            "{name}: the connection was not cut: {v}"
        );
    }
    assert!(!uf.stderr().contains("panicked"), "{}", uf.stderr());
}
