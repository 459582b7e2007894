//! Start-up and shutdown under conditions a person did not plan for: a
//! listener address already taken, a reload that could not bind, the admin
//! token, and a SIGTERM drain that waits for async requests.

#![allow(clippy::unwrap_used)]
mod common;
use common::infer::*;
use common::*;
use std::process::Command;
use std::time::{Duration, Instant};

/// Run `serve` on the config `body` until it exits (see `serve_until_exit`).
fn serve_body(body: &str, limit: Duration) -> (Option<i32>, String) {
    let cfg = scratch("startup").join("u.toml");
    std::fs::write(&cfg, body).unwrap();
    serve_until_exit(&cfg, limit)
}

fn head(dir_tag: &str) -> String {
    let d = scratch(dir_tag);
    format!(
        "[server]\nthreads = 1\npid_file = \"{d}/p\"\nupgrade_sock = \"{d}/s\"\n[log]\naccess_log = \"off\"\n",
        d = d.display()
    )
}

#[test]
fn a_taken_listener_address_fails_serve_with_address_and_cause() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let admin = free_port();
    // A plain traffic listener.
    let (code, err) = serve_body(
        &format!(
            "{}[admin]\nlisten = \"127.0.0.1:{admin}\"\n[[listeners]]\nname = \"web\"\naddress = \"{addr}\"\n",
            head("plain")
        ),
        Duration::from_secs(10),
    );
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains(&format!("listener `web` cannot bind {addr}")),
        "{err}"
    );
    assert!(err.to_lowercase().contains("in use"), "the cause: {err}");
    // The admin listener.
    let (code, err) = serve_body(
        &format!(
            "{}[admin]\nlisten = \"{addr}\"\n[[listeners]]\nname = \"web\"\naddress = \"127.0.0.1:{}\"\n",
            head("admin"),
            free_port()
        ),
        Duration::from_secs(10),
    );
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains(&format!("listener `admin` cannot bind {addr}")),
        "{err}"
    );
    // A TLS listener (bound by our own accept loop).
    let dir = scratch("tlsbind");
    dev_certs(&dir);
    let (code, err) = serve_body(
        &format!(
            "{}[admin]\nlisten = \"\"\n[[listeners]]\nname = \"tls\"\naddress = \"{addr}\"\ntls = {{ certs = [{{ cert = \"{d}/localhost.pem\", key = \"{d}/localhost.key\", names = [\"localhost\"], default = true }}] }}\n",
            head("tls"),
            d = dir.display()
        ),
        Duration::from_secs(10),
    );
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains(&format!("listener `tls` cannot bind {addr}")),
        "{err}"
    );
    drop(taken);
}

#[test]
fn a_reload_whose_new_listener_cannot_bind_is_refused_and_the_old_serves() {
    let origin = Origin::start("o");
    let route = "[[routes]]\npath = \"/\"\npool = \"p\"\n";
    let body = format!("{}{route}", pool_toml("p", &[&origin], ""));
    let uf = Ultrafast::start(&body);
    assert_eq!(uf.get("/").status, 200);
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    uf.write_config(&format!(
        "[[listeners]]\nname = \"extra\"\naddress = \"{addr}\"\n\n{body}"
    ));
    let r = uf.reload();
    assert_ne!(r.status, 200, "{}", r.text());
    assert!(
        r.text()
            .contains(&format!("listener `extra` cannot bind {addr}")),
        "{}",
        r.text()
    );
    assert_eq!(uf.get("/").status, 200, "the old listener serves on");
    assert_eq!(uf.metric("ultrafast_config_reloads_total", &["error"]), 1.0);
}

#[test]
fn the_admin_token_guards_every_endpoint_but_health() {
    let token = "s3cret-admin-token-0123";
    // The harness's generated head has its own [admin], so this config
    // is written whole.
    let dir = scratch("admintok");
    let (port, admin) = (free_port(), free_port());
    let cfg = dir.join("u.toml");
    std::fs::write(
        &cfg,
        format!(
            "{}[admin]\nlisten = \"127.0.0.1:{admin}\"\ntoken = \"{token}\"\n[[listeners]]\nname = \"web\"\naddress = \"127.0.0.1:{port}\"\n",
            head("tok")
        ),
    )
    .unwrap();
    let uf = Ultrafast::spawn(dir, cfg.clone(), port, admin, false);
    let bearer = format!("Bearer {token}");
    for path in ["/metrics", "/admin/config", "/admin/slo"] {
        let r = get(uf.admin, path, &[]);
        assert_eq!(r.status, 401, "{path} without the token");
        assert!(r
            .header("www-authenticate")
            .is_some_and(|v| v.starts_with("Bearer")));
        let wrong = get(
            uf.admin,
            path,
            &[("Authorization", "Bearer s3cret-admin-token-0124")],
        );
        assert_eq!(wrong.status, 401, "{path} with a wrong token");
        let ok = get(uf.admin, path, &[("Authorization", bearer.as_str())]);
        assert_eq!(ok.status, 200, "{path} with the token");
        let lower = format!("bearer {token}");
        let ok = get(uf.admin, path, &[("Authorization", lower.as_str())]);
        assert_eq!(ok.status, 200, "{path}: the scheme is case-insensitive");
    }
    let reload = Client::connect(uf.admin)
        .unwrap()
        .request("POST", "/admin/reload", &[], b"")
        .unwrap();
    assert_eq!(reload.status, 401);
    assert_eq!(get(uf.admin, "/healthz", &[]).status, 200);
    assert_ne!(get(uf.admin, "/readyz", &[]).status, 401);
    // The config view never shows it.
    let view = get(
        uf.admin,
        "/admin/config",
        &[("Authorization", bearer.as_str())],
    )
    .text();
    assert!(!view.contains(token), "{view}");
    // `ultrafast reload` sends the token from the config file.
    let out = Command::new(bin())
        .args(["reload", "-c"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_non_loopback_admin_address_needs_a_token() {
    let dir = scratch("adminpub");
    let cfg = dir.join("u.toml");
    // `check` validates without binding: nothing listens on 0.0.0.0 here.
    let listener = "[[listeners]]\nname = \"web\"\naddress = \"127.0.0.1:8080\"\n";
    std::fs::write(
        &cfg,
        format!("[admin]\nlisten = \"0.0.0.0:9090\"\n{listener}"),
    )
    .unwrap();
    let (code, text) = check(&cfg);
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("admin.listen"), "{text}");
    assert!(text.contains("admin.token"), "{text}");
    std::fs::write(
        &cfg,
        format!(
            "[admin]\nlisten = \"0.0.0.0:9090\"\ntoken = \"a-long-enough-admin-token\"\n{listener}"
        ),
    )
    .unwrap();
    let (code, text) = check(&cfg);
    assert_eq!(code, Some(0), "{text}");
}

/// `ultrafast check -c cfg`: its exit code and what it printed.
fn check(cfg: &std::path::Path) -> (Option<i32>, String) {
    let out = Command::new(bin())
        .args(["check", "-c"])
        .arg(cfg)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text)
}

/// `Prefer: respond-async` chat request; returns the job id.
fn submit_async(uf: &Ultrafast) -> String {
    let body =
        br#"{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}"#;
    let r = Client::connect(uf.addr)
        .unwrap()
        .request(
            "POST",
            "/v1/chat/completions",
            &[
                ("Content-Type", "application/json"),
                ("Prefer", "respond-async"),
            ],
            body,
        )
        .unwrap();
    assert_eq!(r.status, 202, "{}", r.text());
    r.json()["id"].as_str().unwrap().to_string()
}

#[test]
fn sigterm_waits_for_async_jobs_and_logs_what_it_abandons() {
    // A job that takes about 1.5 s finishes before the process exits.
    let fake = Fake::start(&["--ttft-ms", "1200", "--itl-ms", "50", "--tokens", "4"]);
    let body = format!("{INFERENCE_ROUTE}{}", upstream_model("m", &[&fake], ""));
    let mut uf = Ultrafast::start(&body);
    submit_async(&uf);
    let sent = Instant::now();
    uf.signal(15);
    let st = uf
        .wait_exit(Duration::from_secs(9))
        .expect("exits once drained");
    assert!(st.success());
    assert!(
        sent.elapsed() >= Duration::from_millis(1000),
        "it waited for the job"
    );
    assert_eq!(fake.stat("completed"), 1, "{}", fake.stats());
    // A job longer than the grace period is abandoned, and the log says so.
    let slow = Fake::start(&["--ttft-ms", "20000", "--tokens", "4"]);
    let body = format!("{INFERENCE_ROUTE}{}", upstream_model("m", &[&slow], ""));
    drop(uf);
    let dir = scratch("drain");
    let (port, admin) = (free_port(), free_port());
    let path = dir.join("u.toml");
    let cfg = format!(
        "[server]\nthreads = 1\npid_file = \"{d}/p\"\nupgrade_sock = \"{d}/s\"\nshutdown_grace_period_s = 1\n[admin]\nlisten = \"127.0.0.1:{admin}\"\n[log]\naccess_log = \"off\"\n[[listeners]]\nname = \"web\"\naddress = \"127.0.0.1:{port}\"\n{body}",
        d = dir.display()
    );
    std::fs::write(&path, cfg).unwrap();
    let mut uf = Ultrafast::spawn(dir, path, port, admin, false);
    submit_async(&uf);
    assert!(eventually(Duration::from_secs(3), || slow.stat("requests") >= 1));
    uf.signal(15);
    assert!(
        uf.wait_exit(Duration::from_secs(8)).is_some(),
        "exits after the grace period"
    );
    let err = uf.stderr();
    assert!(err.contains("abandoning"), "{err}");
    assert!(err.contains("1 async job(s)"), "{err}");
}
