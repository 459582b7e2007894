//! Three instances as one edge through a real `redis-server` (loopback,
//! an ephemeral port, started and stopped here by PID): a client's request
//! rate and token budget hold in total across the instances; a `202` made
//! on one instance is read, followed (with `Last-Event-ID`) and cancelled
//! on the others, and other tenants see nothing; Redis stopped mid-test
//! gives each limit its `on_store_error` within the store timeout, and
//! shared limits resume when it returns.
#![allow(clippy::unwrap_used)]

mod common;
use common::infer::*;
use common::redis::*;
use common::*;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn cluster(redis: &Redis, tag: &str) -> String {
    format!(
        "[cluster]\nredis = \"{}\"\nprefix = \"{tag}:\"\ntimeout_ms = 100\nheartbeat_ms = 100\n\n",
        redis.url()
    )
}

/// Three instances of `body`, each waiting until it sees all three.
fn three(body: &str) -> Vec<Ultrafast> {
    let ufs: Vec<Ultrafast> = (0..3).map(|_| Ultrafast::start(body)).collect();
    for uf in &ufs {
        let seen = eventually(Duration::from_secs(10), || {
            get(uf.admin, "/admin/cluster", &[]).json()["live_instances"] == 3
        });
        assert!(seen, "{}", get(uf.admin, "/admin/cluster", &[]).text());
    }
    ufs
}

fn status_of(uf: &Ultrafast, path: &str) -> u16 {
    get(uf.addr, path, &[]).status
}

#[test]
fn a_request_rate_holds_in_total_across_three_instances() {
    let redis = Redis::start();
    let origin = Origin::start("o");
    let ufs = three(&format!(
        "{}[rate_limits.per_client]\nkey = \"client_ip\"\nrate_per_s = 2.0\nburst = 5\n\n\
         [pools.p]\nmembers = [{{ addr = \"{}\" }}]\n\n[[routes]]\npath = \"/\"\npool = \"p\"\nrate_limits = [\"per_client\"]\n",
        cluster(&redis, "rate"),
        origin.addr
    ));
    let v = get(ufs[0].admin, "/admin/cluster", &[]).json();
    assert_eq!(v["store"], "up");
    assert_eq!(v["members"].as_array().unwrap().len(), 3, "{v}");
    // 30 requests round robin as fast as they go: one bucket of 5 plus
    // 2/s, not three.
    let t0 = Instant::now();
    let mut ok = 0;
    let mut limited = [0; 3];
    for i in 0..30 {
        match get(ufs[i % 3].addr, "/x", &[]) {
            r if r.status == 200 => ok += 1,
            r => {
                assert_eq!(r.status, 429, "{}", r.text());
                assert!(r.header("retry-after").is_some());
                limited[i % 3] += 1;
            }
        }
    }
    let allowed = 5.0 + 2.0 * t0.elapsed().as_secs_f64();
    assert!(ok >= 5, "{ok} allowed");
    assert!(
        ok as f64 <= allowed.floor() + 1.0,
        "{ok} allowed, the shared limit allows {allowed:.1}"
    );
    assert!(limited.iter().all(|n| *n > 0), "{limited:?}");
    let decisions = ufs[0].metric("ultrafast_cluster_decision_seconds_count", &[]);
    assert!(decisions >= 10.0, "{decisions}");
}

fn chat(max_tokens: u32, key: &str, uf: &Ultrafast, extra: &[(&str, &str)]) -> Resp {
    let body = serde_json::json!({"model": "m", "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "hi"}]})
    .to_string();
    post_as(uf, key, &body, extra)
}

const KEYS: &str = r#"
[[keys]]
name = "alpha"
key = "sk-alpha"
tokens_per_min = 6
burst_tokens = 100

[[keys]]
name = "beta"
key = "sk-beta"
"#;

fn inference_body(redis: &Redis, tag: &str, fake: &Fake) -> String {
    let dir = scratch("keys");
    let file = dir.join("keys.toml");
    std::fs::write(&file, KEYS).unwrap();
    format!(
        "{}[api_keys]\nfile = \"{}\"\n\n{INFERENCE_ROUTE}{}",
        cluster(redis, tag),
        file.display(),
        upstream_model("m", &[fake], "")
    )
}

#[test]
fn a_token_budget_holds_in_total_across_three_instances() {
    let redis = Redis::start();
    // Every request uses all 40 of its tokens, so nothing is refunded.
    let fake = Fake::start(&["--tokens", "40", "--itl-ms", "0"]);
    let ufs = three(&inference_body(&redis, "tokens", &fake));
    // alpha holds 100 tokens (6 a minute back): two requests of 40 and a
    // prompt fit, in total, not two per instance.
    let mut ok = 0;
    let mut refused = 0;
    for i in 0..6 {
        let r = chat(40, "sk-alpha", &ufs[i % 3], &[]);
        match r.status {
            200 => ok += 1,
            429 => {
                assert_eq!(r.json()["error"]["code"], "token_budget", "{}", r.text());
                refused += 1;
            }
            s => panic!("{s}: {}", r.text()),
        }
    }
    assert_eq!(ok, 2, "{ok} of 6 fit a shared budget of 100 tokens");
    assert_eq!(refused, 4);
    // beta has no budget: unaffected.
    assert_eq!(chat(40, "sk-beta", &ufs[1], &[]).status, 200);
}

/// Event ids and payloads of an SSE response read to its end.
fn events(uf: &Ultrafast, key: &str, path: &str, last: Option<usize>) -> Vec<(usize, String)> {
    let mut s = TcpStream::connect(uf.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let last = last
        .map(|l| format!("Last-Event-ID: {l}\r\n"))
        .unwrap_or_default();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n{last}Connection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = Vec::new();
    let mut id = None;
    for line in BufReader::new(s).lines() {
        let Ok(line) = line else { break };
        if let Some(v) = line.strip_prefix("id: ") {
            id = v.trim().parse().ok();
        } else if let Some(d) = line.strip_prefix("data: ") {
            if d == "[DONE]" {
                break;
            }
            out.push((id.take().unwrap(), d.to_string()));
        }
    }
    out
}

#[test]
fn an_async_request_is_followed_resumed_and_cancelled_on_other_instances() {
    let redis = Redis::start();
    let fake = Fake::start(&["--tokens", "400", "--itl-ms", "20"]);
    let ufs = three(&inference_body(&redis, "jobs", &fake));
    let (a, b, c) = (&ufs[0], &ufs[1], &ufs[2]);
    let r = chat(12, "sk-beta", a, &[("Prefer", "respond-async")]);
    assert_eq!(r.status, 202, "{}", r.text());
    let id = r.json()["id"].as_str().unwrap().to_string();
    let loc = r.header("location").unwrap().to_string();
    // Followed live on B from the start: every event, in order, then done.
    let all = events(b, "sk-beta", &loc, None);
    let ids: Vec<usize> = all.iter().map(|(i, _)| *i).collect();
    assert_eq!(ids, (0..all.len()).collect::<Vec<_>>());
    assert!(all.len() >= 12, "{} events", all.len());
    let st = get_as(c, "sk-beta", &format!("/v1/requests/{id}")).json();
    assert_eq!(st["status"], "completed", "{st}");
    assert_eq!(st["result"]["usage"]["completion_tokens"], 12, "{st}");
    // Resumed on C after event 4: exactly the rest, the same payloads.
    let rest = events(c, "sk-beta", &loc, Some(4));
    assert_eq!(rest, all[5..].to_vec());
    // Another tenant sees nothing, on any instance.
    for uf in [a, b, c] {
        assert_eq!(
            get_as(uf, "sk-alpha", &format!("/v1/requests/{id}")).status,
            404
        );
        assert_eq!(get_as(uf, "sk-alpha", &loc).status, 404);
    }
    // A long job started on A, cancelled from C: A stops generating.
    let r = chat(400, "sk-beta", a, &[("Prefer", "respond-async")]);
    assert_eq!(r.status, 202);
    let id = r.json()["id"].as_str().unwrap().to_string();
    assert!(eventually(Duration::from_secs(5), || {
        get_as(b, "sk-beta", &format!("/v1/requests/{id}")).json()["status"] == "in_progress"
    }));
    let del = Client::connect(c.addr)
        .unwrap()
        .request(
            "DELETE",
            &format!("/v1/requests/{id}"),
            &[("Authorization", "Bearer sk-beta")],
            b"",
        )
        .unwrap();
    assert_eq!(del.status, 200, "{}", del.text());
    assert_eq!(del.json()["status"], "cancelled", "{}", del.text());
    // The runner (A) has it cancelled in its own store.
    assert_eq!(
        get_as(a, "sk-beta", &format!("/v1/requests/{id}")).json()["status"],
        "cancelled"
    );
    let n = get_as(b, "sk-beta", &format!("/v1/requests/{id}")).json()["events"]
        .as_u64()
        .unwrap();
    assert!(n < 100, "generation went on after the cancel: {n} events");
    assert!(eventually(Duration::from_secs(5), || fake
        .stat("cancelled")
        >= 1));
}

#[test]
fn a_store_outage_falls_back_per_limit_and_recovers() {
    let mut redis = Redis::start();
    let origin = Origin::start("o");
    let limit = |name: &str, rate: f64, burst: u32, mode: &str| {
        format!(
            "[rate_limits.{name}]\nkey = \"client_ip\"\nrate_per_s = {rate}\nburst = {burst}\non_store_error = \"{mode}\"\n\n"
        )
    };
    let route = |path: &str, limit: &str| {
        format!("[[routes]]\npath = \"{path}\"\npool = \"p\"\nrate_limits = [\"{limit}\"]\n\n")
    };
    let ufs = three(&format!(
        "{}{}{}{}[pools.p]\nmembers = [{{ addr = \"{}\" }}]\n\n{}{}{}",
        cluster(&redis, "outage"),
        limit("local", 30.0, 30, "local"),
        limit("open", 1.0, 1, "open"),
        limit("closed", 100.0, 100, "closed"),
        origin.addr,
        route("/local", "local"),
        route("/open", "open"),
        route("/closed", "closed"),
    ));
    assert_eq!(status_of(&ufs[0], "/closed"), 200);
    redis.stop();
    // The first decision after the stop waits at most the store timeout
    // (100 ms), then falls back; the ones after it do not wait at all.
    let t = Instant::now();
    let first = status_of(&ufs[0], "/local");
    assert_eq!(first, 200);
    assert!(
        t.elapsed() < Duration::from_millis(600),
        "{:?}",
        t.elapsed()
    );
    for uf in &ufs {
        assert!(eventually(Duration::from_secs(5), || uf
            .metric("ultrafast_cluster_store_up", &[])
            == 0.0));
    }
    // local: 30/s in total is 10/s per instance now (burst 10 each);
    // 2 requests a second to each instance are all allowed.
    for i in 0..12 {
        let t = Instant::now();
        assert_eq!(status_of(&ufs[i % 3], "/local"), 200, "request {i}");
        assert!(
            t.elapsed() < Duration::from_millis(300),
            "{:?}",
            t.elapsed()
        );
        std::thread::sleep(Duration::from_millis(150));
    }
    // open: a 1/s limit lets everything through while the store is away.
    for i in 0..6 {
        assert_eq!(status_of(&ufs[i % 3], "/open"), 200, "request {i}");
    }
    // closed: refused with a 503 that says why.
    let r = get(ufs[1].addr, "/closed", &[]);
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.header("x-ultrafast-shed"), Some("store_unavailable"));
    assert!(r.header("retry-after").is_some());
    for mode in ["local", "open", "closed"] {
        let n: f64 = ufs
            .iter()
            .map(|u| u.metric("ultrafast_cluster_fallback_decisions_total", &[mode]))
            .sum();
        assert!(n >= 1.0, "{mode}: {n}");
    }
    assert!(ufs[0].stderr().contains("cluster store unreachable"));
    // Redis returns: every instance finds it again and limits are shared.
    redis.resume();
    for uf in &ufs {
        assert!(eventually(Duration::from_secs(10), || uf
            .metric("ultrafast_cluster_store_up", &[])
            == 1.0));
        assert!(uf.metric("ultrafast_cluster_store_transitions_total", &["\"up\""]) >= 1.0);
    }
    assert_eq!(status_of(&ufs[2], "/closed"), 200);
    let statuses: Vec<u16> = (0..4).map(|i| status_of(&ufs[i % 3], "/open")).collect();
    assert_eq!(
        statuses.iter().filter(|s| **s == 200).count(),
        1,
        "{statuses:?}"
    );
    assert!(ufs[0].stderr().contains("reachable again"));
}

#[test]
fn the_store_url_carries_tls_and_a_password() {
    // A TLS-only Redis that wants a password, with the dev CA's localhost
    // certificate; ultrafast trusts that CA through SSL_CERT_FILE.
    let dir = scratch("redis-tls");
    let certs = dir.join("certs");
    let (cert, key) = dev_certs(&certs);
    let port = free_port();
    let cmd = Command::new("redis-server")
        .args([
            "--bind",
            "127.0.0.1",
            "--port",
            "0",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .args(["--tls-port", &port.to_string(), "--tls-auth-clients", "no"])
        .arg("--tls-cert-file")
        .arg(&cert)
        .arg("--tls-key-file")
        .arg(&key)
        .arg("--tls-ca-cert-file")
        .arg(certs.join("ca.pem"))
        .args(["--requirepass", "s3cret"])
        .arg("--dir")
        .arg(&dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
    let _redis = Reap(cmd.unwrap());
    assert!(eventually(Duration::from_secs(10), || TcpStream::connect(
        ("127.0.0.1", port)
    )
    .is_ok()));
    let origin = Origin::start("o");
    let body = |url: &str| {
        format!(
            "[cluster]\nredis = \"{url}\"\nprefix = \"tls:\"\ntimeout_ms = 200\nheartbeat_ms = 100\n\n\
             [rate_limits.one]\nkey = \"client_ip\"\nrate_per_s = 1.0\nburst = 2\non_store_error = \"closed\"\n\n\
             [pools.p]\nmembers = [{{ addr = \"{}\" }}]\n\n[[routes]]\npath = \"/\"\npool = \"p\"\nrate_limits = [\"one\"]\n",
            origin.addr
        )
    };
    let ca = certs.join("ca.pem").display().to_string();
    let env = [("SSL_CERT_FILE", ca.as_str())];
    let uf =
        Ultrafast::start_with_env(&body(&format!("rediss://:s3cret@localhost:{port}/0")), &env);
    let up = eventually(Duration::from_secs(10), || {
        get(uf.admin, "/admin/cluster", &[]).json()["live_instances"] == 1
            && uf.metric("ultrafast_cluster_store_up", &[]) == 1.0
    });
    assert!(up, "{}", uf.stderr());
    // The shared limit answers (closed: a refusal would be a 503).
    let statuses: Vec<u16> = (0..3).map(|_| status_of(&uf, "/x")).collect();
    assert_eq!(statuses, [200, 200, 429], "{}", uf.stderr());
    // A wrong password is a store that does not answer: closed refuses.
    let bad =
        Ultrafast::start_with_env(&body(&format!("rediss://:wrong@localhost:{port}/0")), &env);
    assert!(eventually(Duration::from_secs(5), || status_of(&bad, "/x") == 503));
}

/// A child process stopped (by PID) when the test ends, even on a panic.
struct Reap(Child);

impl Drop for Reap {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn an_async_request_outlives_a_store_outage() {
    let redis = Redis::start();
    let fake = Fake::start(&["--tokens", "400", "--itl-ms", "10"]);
    let ufs = three(&inference_body(&redis, "jobs-outage", &fake));
    let (a, b) = (&ufs[0], &ufs[1]);
    let r = chat(150, "sk-beta", a, &[("Prefer", "respond-async")]);
    assert_eq!(r.status, 202, "{}", r.text());
    let id = r.json()["id"].as_str().unwrap().to_string();
    let loc = format!("/v1/requests/{id}/events");
    // B follows; the store goes away mid-stream: B's stream ends with an
    // error event and no [DONE], since the job is not over.
    let mut s = TcpStream::connect(b.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET {loc} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-beta\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut lines = BufReader::new(s).lines();
    let mut seen = 0;
    while seen < 10 {
        if lines.next().unwrap().unwrap().starts_with("data: ") {
            seen += 1;
        }
    }
    redis.signal("-STOP");
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    assert!(rest.iter().any(|l| l == "event: error"), "{rest:?}");
    assert!(rest.iter().any(|l| l.contains("events_unavailable")));
    assert!(!rest.iter().any(|l| l == "data: [DONE]"), "{rest:?}");
    // The runner goes on and finishes; its end reaches the store once the
    // store is back, marked incomplete (events were lost meanwhile).
    assert!(eventually(Duration::from_secs(10), || {
        get_as(a, "sk-beta", &format!("/v1/requests/{id}")).json()["status"] == "completed"
    }));
    redis.signal("-CONT");
    let remote = eventually(Duration::from_secs(10), || {
        let v = get_as(b, "sk-beta", &format!("/v1/requests/{id}")).json();
        v["status"] == "completed" && v["events_incomplete"] == true
    });
    assert!(
        remote,
        "{}",
        get_as(b, "sk-beta", &format!("/v1/requests/{id}")).text()
    );
    // The runner still serves the whole stream.
    let all = events(a, "sk-beta", &loc, None);
    assert!(all.len() >= 150, "{}", all.len());
}

/// Fair shares across instances: a tenant served on one instance counts
/// on the other, so on the other a tenant it competes with gets most of
/// the slots (on its own each instance would split them 1:1); with
/// `fair_on_store_error = "closed"`, a store that stops answering refuses
/// inference requests (503 `store_unavailable`), and they pass again when
/// it returns.
#[test]
fn a_tenant_served_on_one_instance_counts_on_the_others() {
    let redis = Redis::start();
    let fake = Fake::start(&["--tokens", "6", "--itl-ms", "25"]);
    let body = |closed: &str| {
        format!(
            "{}fair_on_store_error = \"{closed}\"\n\n[inference]\ntenant = \"header:x-tenant\"\n\n{INFERENCE_ROUTE}{}",
            cluster(&redis, "fair"),
            upstream_model("m", &[&fake], "max_concurrency = 1"),
        )
    };
    let a = Ultrafast::start(&body("local"));
    let b = Ultrafast::start(&body("closed"));
    // heavy keeps `a` busy alone while it competes with light on `b`.
    let a_addr = a.addr;
    let on_a =
        std::thread::spawn(move || closed_loops(a_addr, &[(header("x-tenant", "heavy"), 6)], 6));
    let on_b = closed_loops(
        b.addr,
        &[
            (header("x-tenant", "heavy"), 6),
            (header("x-tenant", "light"), 6),
        ],
        6,
    );
    let on_a = on_a.join().unwrap();
    eprintln!("served: heavy on a {on_a:?}; heavy, light on b {on_b:?}");
    assert!(on_a[0] >= 10, "heavy on a: {on_a:?}");
    let (heavy, light) = (on_b[0] as f64, on_b[1] as f64);
    assert!(
        light >= 0.7 * (heavy + light),
        "on b heavy {heavy}, light {light}: heavy's service on a did not count"
    );
    // One counter per tenant, each expiring on its own after 300 s idle:
    // tenant names a client chooses cannot grow the store for ever (one
    // hash kept every name while any tenant was active).
    let url = redis.url();
    let port = url
        .rsplit(':')
        .next()
        .unwrap()
        .split('/')
        .next()
        .unwrap()
        .to_string();
    let cli = |args: &[&str]| {
        let out = std::process::Command::new("redis-cli")
            .args(["-p", &port])
            .args(args)
            .output()
            .expect("redis-cli (Debian redis-tools, with redis-server)");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let keys: Vec<String> = cli(&["--scan", "--pattern", "*fair:m:*"])
        .lines()
        .map(String::from)
        .collect();
    for t in ["heavy", "light"] {
        assert!(
            keys.iter().any(|k| k.ends_with(&format!(":{t}"))),
            "{keys:?}"
        );
    }
    for k in &keys {
        let ttl: i64 = cli(&["TTL", k]).trim().parse().unwrap();
        assert!((1..=300).contains(&ttl), "{k}: TTL {ttl}");
    }
    // The store stops answering: b refuses, within its timeout.
    redis.signal("-STOP");
    let chat = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":2}"#;
    let refused = eventually(Duration::from_secs(5), || {
        let r = post_to(&b, "/v1/chat/completions", chat, &[]);
        r.status == 503 && r.text().contains("store")
    });
    assert!(refused, "b kept serving with the store down");
    // a (local) keeps serving.
    assert_eq!(post_to(&a, "/v1/chat/completions", chat, &[]).status, 200);
    redis.signal("-CONT");
    let back = eventually(Duration::from_secs(5), || {
        post_to(&b, "/v1/chat/completions", chat, &[]).status == 200
    });
    assert!(back, "b did not serve again when the store returned");
}
