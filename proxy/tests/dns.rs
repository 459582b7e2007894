//! DNS prefetch against a real DNS server on loopback whose answers and TTLs
//! the test changes: pools follow new addresses within the TTL without a
//! request ever waiting on DNS, stale answers are served while the server is
//! silent, unresolvable names fail the reload (not the running config), and
//! /etc/hosts is honoured.

#![allow(clippy::unwrap_used)]
mod common;
use common::*;
use std::time::{Duration, Instant};

fn dns_config(dns: &DnsServer, member: &str, extra_dns: &str) -> String {
    format!(
        "[dns]\nnameservers = [\"{}\"]\nmin_ttl_s = 1\ntimeout_ms = 300\n{extra_dns}\n\
         [pools.p]\nmembers = [{{ addr = \"{member}\" }}]\nretry = {{ attempts = 2, budget_ratio = 1.0 }}\n\
         [[routes]]\npath = \"/\"\npool = \"p\"\n",
        dns.addr
    )
}

/// Two origins on the same port of two loopback addresses.
fn twin_origins() -> (Origin, Origin, u16) {
    for _ in 0..20 {
        let port = free_port();
        let a = Origin::start_at("a", &format!("127.0.0.2:{port}"));
        if let Ok(l) = std::net::TcpListener::bind(format!("127.0.0.3:{port}")) {
            drop(l);
            let b = Origin::start_at("b", &format!("127.0.0.3:{port}"));
            return (a, b, port);
        }
    }
    panic!("no common free port on 127.0.0.2/3");
}

#[test]
fn pool_follows_dns_changes_and_no_request_waits_on_dns() {
    let dns = DnsServer::start();
    let (_a, b, port) = twin_origins();
    dns.set("svc.test", &["127.0.0.2"], 1);
    let uf = Ultrafast::start(&dns_config(&dns, &format!("svc.test:{port}"), ""));
    assert_eq!(uf.get("/").origin(), "a");
    dns.set("svc.test", &["127.0.0.3"], 1);
    let start = Instant::now();
    let mut slowest = Duration::ZERO;
    let mut switched = None;
    let mut c = Client::connect(uf.addr).unwrap();
    while start.elapsed() < Duration::from_secs(5) {
        let t = Instant::now();
        let r = c.request("GET", "/", &[], b"").unwrap();
        slowest = slowest.max(t.elapsed());
        assert_eq!(r.status, 200);
        if r.origin() == "b" {
            switched = Some(start.elapsed());
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let switched = switched.expect("pool never followed the new address");
    assert!(
        switched < Duration::from_millis(2500),
        "took {switched:?} for a 1 s TTL"
    );
    assert!(
        slowest < Duration::from_millis(150),
        "a request waited {slowest:?}"
    );
    // Two addresses: both become members, and the connection to the
    // address that stayed is kept.
    let b_conns = b.connections();
    dns.set("svc.test", &["127.0.0.2", "127.0.0.3"], 1);
    assert!(eventually(Duration::from_secs(4), || uf
        .metric("ultrafast_pool_members", &["pool=\"p\""])
        == 2.0));
    let mut c = Client::connect(uf.addr).unwrap();
    let hits_b = (0..10)
        .filter(|_| c.request("GET", "/", &[], b"").unwrap().origin() == "b")
        .count();
    assert!(hits_b > 0);
    assert_eq!(
        b.connections(),
        b_conns,
        "a connection to an address that stayed was dropped"
    );
    assert!(uf.metric("ultrafast_dns_queries_total", &["result=\"ok\""]) >= 3.0);
}

#[test]
fn a_silent_resolver_means_serving_the_last_good_answer() {
    let dns = DnsServer::start();
    let (_a, _b, port) = twin_origins();
    dns.set("svc.test", &["127.0.0.2"], 1);
    let uf = Ultrafast::start(&dns_config(
        &dns,
        &format!("svc.test:{port}"),
        "stale_max_s = 60",
    ));
    dns.set_silent(true);
    let label = "name=\"svc.test\"";
    assert!(eventually(Duration::from_secs(5), || uf
        .metric("ultrafast_dns_stale_answer", &[label])
        == 1.0));
    for _ in 0..10 {
        let t = Instant::now();
        let r = uf.get("/");
        assert_eq!((r.status, r.origin()), (200, "a".to_string()));
        assert!(t.elapsed() < Duration::from_millis(150));
    }
    assert!(
        uf.metric("ultrafast_dns_queries_total", &["result=\"timeout\""])
            + uf.metric("ultrafast_dns_queries_total", &["result=\"error\""])
            >= 1.0
    );
    dns.set_silent(false);
    assert!(eventually(Duration::from_secs(5), || uf
        .metric("ultrafast_dns_stale_answer", &[label])
        == 0.0));
}

#[test]
fn a_name_that_never_resolves_fails_the_reload_not_the_running_config() {
    let dns = DnsServer::start();
    let (_a, _b, port) = twin_origins();
    dns.set("svc.test", &["127.0.0.2"], 30);
    let uf = Ultrafast::start(&dns_config(&dns, &format!("svc.test:{port}"), ""));
    uf.write_config(&dns_config(&dns, &format!("nope.test:{port}"), ""));
    let r = uf.reload();
    assert_eq!(r.status, 400);
    let e = &r.json()["errors"][0];
    assert_eq!(e["field"], "pools.p.members[0].addr");
    assert!(e["message"].as_str().unwrap().contains("nope.test"), "{e}");
    assert_eq!(uf.get("/").origin(), "a");
    // And at startup: a clear error with the location, exit 1.
    let dir = scratch("dnsbad");
    let cfg = dir.join("bad.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[listeners]]\naddress = \"127.0.0.1:{}\"\n{}",
            free_port(),
            dns_config(&dns, "nope.test:80", "")
        ),
    )
    .unwrap();
    let out = std::process::Command::new(bin())
        .arg("check")
        .arg("-c")
        .arg(&cfg)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("pools.p.members[0].addr"));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn etc_hosts_is_honoured() {
    let dns = DnsServer::start();
    let a = Origin::start("a");
    // The DNS server knows nothing; localhost comes from /etc/hosts.
    let uf = Ultrafast::start(&dns_config(
        &dns,
        &format!("localhost:{}", a.addr.port()),
        "",
    ));
    let r = uf.get("/");
    assert_eq!((r.status, r.origin()), (200, "a".to_string()));
}
