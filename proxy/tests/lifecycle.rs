//! Process lifecycle: SIGTERM drains in-flight requests, a graceful upgrade
//! hands the listening sockets to a new process without a failed request,
//! and the admin endpoints (metrics that pass `promtool`, health, ready).

#![allow(clippy::unwrap_used)]
mod common;
use common::*;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn route(pool: &str) -> String {
    format!("[[routes]]\npath = \"/\"\npool = \"{pool}\"\n")
}

#[test]
fn sigterm_drains_an_in_flight_slow_request() {
    let a = Origin::start("a");
    a.state.delay_ms.store(1500, Ordering::SeqCst);
    let mut uf = Ultrafast::start(&format!("{}{}", pool_toml("p", &[&a], ""), route("p")));
    // The pid file names the serving process, and goes with it.
    let pid_file = uf.dir.join("uf.pid");
    assert_eq!(
        std::fs::read_to_string(&pid_file).unwrap().trim(),
        uf.child.id().to_string()
    );
    let addr = uf.addr;
    let slow = std::thread::spawn(move || get(addr, "/slow", &[]));
    assert!(eventually(Duration::from_secs(3), || a.requests() == 1));
    let sent = Instant::now();
    uf.signal(15);
    // New connections are refused once the listener closes...
    assert!(eventually(Duration::from_secs(3), || {
        std::net::TcpStream::connect(addr).is_err()
    }));
    // ...while the request in flight completes normally.
    let r = slow.join().unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.origin(), "a");
    // And the process exits as soon as it is drained, well before the 10 s grace period.
    let status = uf
        .wait_exit(Duration::from_secs(8))
        .expect("did not exit after draining");
    assert!(status.success(), "{status:?}");
    assert!(!pid_file.exists(), "the pid file outlived the process");
    assert!(
        sent.elapsed() < Duration::from_secs(6),
        "took {:?}",
        sent.elapsed()
    );
}

/// The config of an upgrade that adds the listener `extra` at `addr`.
fn with_extra_listener(old: &Ultrafast, addr: &str, body: &str) -> std::path::PathBuf {
    let cfg = old
        .dir
        .join(format!("upgrade-{}.toml", addr.replace([':', '.'], "-")));
    let extra = format!("[[listeners]]\nname = \"extra\"\naddress = \"{addr}\"\n\n");
    std::fs::write(&cfg, format!("{}{extra}{body}", old.head)).unwrap();
    cfg
}

#[test]
fn an_upgrade_binds_its_new_listeners_before_the_old_process_goes() {
    let a = Origin::start("a");
    let body = format!("{}{}", pool_toml("p", &[&a], ""), route("p"));
    let mut old = Ultrafast::start(&body);
    // An address that cannot be bound here (TEST-NET-1 is on no interface):
    // the new process says so and exits at once, before waiting for the
    // old one's sockets, and the old one goes on serving.
    let cfg = with_extra_listener(&old, "192.0.2.1:8080", &body);
    let mut bad = Ultrafast::spawn(
        old.dir.clone(),
        cfg,
        old.addr.port(),
        old.admin.port(),
        true,
    );
    let status = bad
        .wait_exit(Duration::from_secs(10))
        .expect("a failed upgrade kept running");
    assert!(!status.success());
    let err = std::fs::read_to_string(old.dir.join("stderr.upgrade.log")).unwrap();
    assert!(
        err.contains("listener `extra` cannot bind 192.0.2.1:8080"),
        "{err}"
    );
    assert_eq!(get(old.addr, "/", &[]).status, 200);
    // A new address that can be bound: bound by the new process before it
    // takes the old one's sockets; after SIGQUIT both are served by it.
    let port = free_port();
    let cfg = with_extra_listener(&old, &format!("127.0.0.1:{port}"), &body);
    let new = Ultrafast::spawn(
        old.dir.clone(),
        cfg,
        old.addr.port(),
        old.admin.port(),
        true,
    );
    let extra: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    assert!(
        eventually(Duration::from_secs(5), || std::net::TcpStream::connect(
            extra
        )
        .is_ok()),
        "the new listener is not bound before the handover"
    );
    std::thread::sleep(Duration::from_millis(300));
    old.signal(3);
    assert!(
        old.wait_exit(Duration::from_secs(10)).is_some(),
        "old process did not exit"
    );
    assert!(eventually(Duration::from_secs(5), || get(extra, "/", &[])
        .status
        == 200));
    assert_eq!(get(new.addr, "/", &[]).status, 200);
    assert_eq!(get(new.admin, "/healthz", &[]).status, 200);
    drop(new);
}

#[test]
fn graceful_upgrade_hands_over_sockets_without_failing_a_request() {
    let a = Origin::start("a");
    let mut old = Ultrafast::start(&format!("{}{}", pool_toml("p", &[&a], ""), route("p")));
    let (addr, stop) = (old.addr, Arc::new(AtomicBool::new(false)));
    let (ok, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let load = {
        let (stop, ok, failed) = (stop.clone(), ok.clone(), failed.clone());
        std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(20);
            let mut n = 0;
            while !stop.load(Ordering::SeqCst) && Instant::now() < deadline && n < 400_000 {
                n += 1;
                match Client::connect(addr).and_then(|mut c| c.request("GET", "/", &[], b"")) {
                    Ok(r) if r.status == 200 => ok.fetch_add(1, Ordering::SeqCst),
                    _ => failed.fetch_add(1, Ordering::SeqCst),
                };
            }
        })
    };
    assert!(eventually(Duration::from_secs(3), || ok
        .load(Ordering::SeqCst)
        > 50));
    // The new binary waits on the upgrade socket; SIGQUIT to the old one
    // sends it the listening sockets, then the old one drains and exits.
    let new = Ultrafast::spawn(
        old.dir.clone(),
        old.config.clone(),
        old.addr.port(),
        old.admin.port(),
        true,
    );
    std::thread::sleep(Duration::from_millis(500));
    // Until it has the sockets, the pid file still names the old process
    // (the README's `kill -QUIT $(cat ...pid)`).
    let pid_file = old.dir.join("uf.pid");
    let pid_in_file = || std::fs::read_to_string(&pid_file).unwrap_or_default();
    assert_eq!(pid_in_file().trim(), old.child.id().to_string());
    old.signal(3);
    let exited = old
        .wait_exit(Duration::from_secs(10))
        .expect("old process did not exit");
    assert!(exited.success(), "{exited:?}");
    let before = ok.load(Ordering::SeqCst);
    assert!(
        eventually(Duration::from_secs(3), || ok.load(Ordering::SeqCst)
            > before + 50),
        "new process is not serving"
    );
    stop.store(true, Ordering::SeqCst);
    load.join().unwrap();
    assert_eq!(
        failed.load(Ordering::SeqCst),
        0,
        "{} ok, some failed",
        ok.load(Ordering::SeqCst)
    );
    assert_eq!(get(new.admin, "/healthz", &[]).status, 200);
    // The old process left the new one's pid in place.
    assert_eq!(pid_in_file().trim(), new.child.id().to_string());
    drop(new);
}

#[test]
fn metrics_pass_promtool_and_health_endpoints_answer() {
    let (a, b) = (Origin::start("a"), Origin::start("b"));
    let uf = Ultrafast::start(&format!(
        "{}{}[[routes]]\nname = \"fixed\"\npath = \"/fixed\"\nreturn = {{ status = 200, body = \"x\" }}\n",
        pool_toml("p", &[&a, &b], "health_check = { path = \"/health\", interval_ms = 100 }"),
        route("p")
    ));
    for p in ["/", "/a", "/fixed", "/fixed"] {
        uf.get(p);
    }
    assert_eq!(get(uf.admin, "/healthz", &[]).status, 200);
    assert_eq!(get(uf.admin, "/readyz", &[]).status, 200);
    assert_eq!(get(uf.admin, "/nope", &[]).status, 404);
    // Requests are counted in the logging phase, just after the response
    // is written: poll until the counts are in.
    let wanted = [
        "ultrafast_requests_total{class=\"2xx\",pool=\"p\",route=\"route0\"} 2",
        "ultrafast_requests_total{class=\"2xx\",pool=\"none\",route=\"fixed\"} 2",
        "ultrafast_upstream_response_seconds_count{pool=\"p\"} 2",
        "ultrafast_upstream_member_healthy{",
        "ultrafast_upstream_connections_total{pool=\"p\",reused=\"false\"}",
        // Exported at 0 before the first reload of either outcome.
        "ultrafast_config_reloads_total{result=\"error\"} 0",
    ];
    let mut text = String::new();
    let complete = eventually(Duration::from_secs(5), || {
        text = uf.metrics();
        wanted.iter().all(|m| text.contains(m))
    });
    assert!(complete, "missing some of {wanted:?} in:\n{text}");
    let file = uf.dir.join("metrics.txt");
    std::fs::write(&file, &text).unwrap();
    let out = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::fs::File::open(&file).unwrap())
        .output()
        .expect(
            "promtool is required for this test (Debian package `prometheus`; .ci/run installs it)",
        );
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && report.trim().is_empty(),
        "promtool: {report}"
    );
}

#[test]
fn serve_with_a_broken_config_exits_1_with_the_location() {
    let dir = scratch("broken");
    let cfg = dir.join("bad.toml");
    std::fs::write(&cfg, "[[listeners]]\naddress = \"127.0.0.1:1\"\n[pools.p]\nmembers = [{ addr = \"127.0.0.1:2\", weight = 0 }]\n").unwrap();
    let out = std::process::Command::new(bin())
        .arg("serve")
        .arg("-c")
        .arg(&cfg)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("{}:4:", cfg.display())) && err.contains("pools.p.members[0].weight"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// Voluntary context switches of the server's thread whose name starts
/// with `name` (Linux `/proc`), or None while there is no such thread.
fn thread_switches(pid: u32, name: &str) -> Option<u64> {
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).ok()? {
        let dir = t.ok()?.path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        if comm.starts_with(name) {
            let status = std::fs::read_to_string(dir.join("status")).ok()?;
            return status
                .lines()
                .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
                .and_then(|v| v.trim().parse().ok());
        }
    }
    None
}

#[test]
fn idle_background_loops_sleep_until_a_reload_gives_them_work() {
    let a = Origin::start("a");
    let uf = Ultrafast::start(&format!("{}{}", pool_toml("p", &[&a], ""), route("p")));
    let pid = uf.child.id();
    // The loops that have nothing configured: no health check, no
    // queue-aware pool, no host names, no SLA watchdog. Before, each woke
    // every 50-100 ms (10-20 switches a second).
    let loops = ["BG health", "BG load", "BG dns", "BG slo"];
    assert!(
        eventually(Duration::from_secs(5), || loops
            .iter()
            .all(|l| thread_switches(pid, l).is_some())),
        "the background threads {loops:?} did not start"
    );
    std::thread::sleep(Duration::from_millis(300));
    let before: Vec<u64> = loops
        .iter()
        .map(|l| thread_switches(pid, l).unwrap_or(0))
        .collect();
    std::thread::sleep(Duration::from_secs(2));
    for (l, b) in loops.iter().zip(&before) {
        let after = thread_switches(pid, l).unwrap_or(0);
        assert!(
            after - b <= 3,
            "{l} woke {} times in 2 s with nothing to do",
            after - b
        );
    }
    // A reload that adds a health check starts it at once, not after the
    // idle loop's minute: the failing member is taken out within seconds.
    a.state.health_status.store(503, Ordering::SeqCst);
    uf.write_config(&format!(
        "{}{}",
        pool_toml(
            "p",
            &[&a],
            "health_check = { path = \"/health\", interval_ms = 100 }"
        ),
        route("p")
    ));
    assert_eq!(uf.reload().status, 200);
    assert!(
        eventually(Duration::from_secs(5), || uf.metrics().lines().any(|l| l
            .starts_with("ultrafast_upstream_member_healthy{")
            && l.ends_with(" 0"))),
        "the health check added by the reload did not mark the failing member within 5 s"
    );
}
