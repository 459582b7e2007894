//! What an operator looks at agrees with what the server counts: the live
//! status page (`/status`, rendered by headless Chromium from
//! `/admin/stats`) shows the same figures a `/metrics` scrape gives (KV
//! blocks, running and waiting sequences, generated tokens, per-lane request
//! counts and TTFT / inter-token percentiles recomputed here from the
//! histogram buckets the way Prometheus's `histogram_quantile` does, pool
//! members, the config hash); every query of the Grafana dashboard
//! (`conf/grafana/ultrafast.json`) answers with data in a real Prometheus
//! scraping a server that served inference on both backends, TLS with
//! resumption, shed load, a reload and refused requests; and the exposition,
//! `vllm:*` families included, passes `promtool check metrics`.
#![allow(clippy::unwrap_used)]

mod common;
use common::infer::*;
use common::*;
use regex::Regex;
use std::collections::BTreeMap;
use std::io::Write;
use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

const MODEL: &str = "smollm2-135m-instruct";

/// Lanes with targets on `ultra` (generous: nothing here may be refused for
/// its prediction) and the default lane of routes, `standard`.
const LANES: &str = "[lanes.ultra]\nrank = 0\nttft_slo_ms = 20000\nitl_slo_ms = 1000\n\n\
                     [lanes.standard]\nrank = 1\n\n";

/// A watchdog on `fm` with short windows, so `ultrafast_slo_state` is set
/// within the test's traffic.
const WATCHDOG: &str = "watchdog = { window_ms = 1000, enter_after = 2, leave_after = 2, min_samples = 3, probe_interval_ms = 500, ttft_ms = 5000 }";

const NEED_CHROMIUM: &str =
    "chromium is required for this test (Debian package `chromium`; .ci/run must install it)";
const NEED_PROMETHEUS: &str =
    "prometheus is required for this test (Debian package `prometheus`; .ci/run installs it)";
const NEED_PROMTOOL: &str =
    "promtool is required for this test (Debian package `prometheus`; .ci/run installs it)";
const NEED_OPENSSL: &str =
    "openssl is required for this test (Debian package `openssl`; .ci/run installs it)";

fn engine_model() -> String {
    format!(
        "[models.{MODEL}]\nbackend = \"engine\"\nsource = \"{MODEL}\"\nkv_blocks = 256\nmax_num_seqs = 8\nwarmup_prompt_lens = [16]\nmax_concurrency = 8\n\n"
    )
}

#[test]
fn the_status_page_shows_what_metrics_say() {
    let _one = one_at_a_time();
    let fake = Fake::start(&[
        "--name",
        "fm",
        "--tokens",
        "8",
        "--ttft-ms",
        "20",
        "--itl-ms",
        "5",
    ]);
    let uf = Ultrafast::start(&format!(
        "{INFERENCE_ROUTE}{LANES}{}{}",
        engine_model(),
        upstream_model_in("fm", &[&fake], "", "")
    ));
    uf.wait_models_ready(Duration::from_secs(300));

    // Bounded load on both backends and both lanes, whole and streamed
    // (streams give the inter-token figures).
    let traffic_start = Instant::now();
    for model in [MODEL, "fm"] {
        for i in 0..6u32 {
            whole(uf.addr, model, i.is_multiple_of(2).then_some("ultra"), 8);
        }
        for i in 0..4u32 {
            streamed(uf.addr, model, i.is_multiple_of(2).then_some("ultra"), 8);
        }
    }
    // Let the counts land (they are taken as responses finish) and the
    // engine and pool go idle, so that the gauges the page shows cannot
    // move between its last poll and the scrape compared with it.
    std::thread::sleep(Duration::from_millis(1500));
    let idle = eventually(Duration::from_secs(10), || {
        let s = Scrape::parse(&uf.metrics());
        s.sum("vllm:num_requests_running", &[]) == 0.0
            && s.sum("vllm:num_requests_waiting", &[]) == 0.0
            && s.sum("ultrafast_upstream_member_in_flight", &[]) == 0.0
            && s.sum("ultrafast_engine_kv_blocks", &[("state", "used")]) == 0.0
    });
    assert!(idle, "the server did not go idle:\n{}", uf.metrics());

    // The page as a browser renders it: the DOM first (its lane figures
    // cover the last minute, so it is taken as close to the traffic as
    // possible), then a screenshot for people.
    let dir = scratch("chromium");
    let url = format!("http://{}/status", uf.admin);
    let dump = chromium(&dir, "dom", "--dump-dom", &url);
    let dom_after = traffic_start.elapsed();
    let dom = dump.stdout.clone();
    let html_copy = concat!(env!("CARGO_TARGET_TMPDIR"), "/status-page.html");
    std::fs::write(html_copy, &dom).unwrap();
    assert!(
        dom.contains("</html>") && dom.contains("data-updates"),
        "no DOM from chromium ({:?}):\n{}\n{}",
        dump.code,
        tail(&dom, 2000),
        tail(&dump.stderr, 4000)
    );
    let shot = concat!(env!("CARGO_TARGET_TMPDIR"), "/status-page.png");
    let _ = std::fs::remove_file(shot);
    let ran = chromium(&dir, "shot", &format!("--screenshot={shot}"), &url);
    eprintln!("status page screenshot: {shot} (DOM: {html_copy})");
    let size = std::fs::metadata(shot).map(|m| m.len()).unwrap_or(0);
    assert!(
        size > 10_000,
        "screenshot {shot} is {size} bytes ({:?}): {}",
        ran.code,
        tail(&ran.stderr, 4000)
    );

    let updates = body_updates(&dom);
    assert!(
        updates >= 2,
        "the page rendered {updates} time(s):\n{}",
        tail(&dom, 4000)
    );
    // The page's percentiles and counts are over the last minute; they can
    // equal the all-time histograms only if all traffic falls inside it.
    assert!(
        dom_after < Duration::from_secs(55),
        "{dom_after:?} from the first request to the DOM: longer than the page's one-minute window, so its counts cannot be compared with the totals"
    );
    let figs = figures(&dom);
    assert!(
        figs.len() > 20,
        "few figures on the page: {figs:?}\n{}",
        tail(&dom, 4000)
    );
    let plots = plot_points(&dom);
    assert!(
        plots.iter().any(|(_, n)| *n >= 1),
        "no plot has a point: {plots:?}"
    );

    let text = uf.metrics();
    let scrape = Scrape::parse(&text);
    let mut cmp = Compare {
        figs: &figs,
        bad: Vec::new(),
    };
    // Config: the hash the page shows is the active one.
    let hashes: Vec<&str> = scrape
        .series("ultrafast_config_info", &[])
        .into_iter()
        .filter_map(|s| s.labels.get("hash").map(String::as_str))
        .collect();
    assert_eq!(hashes.len(), 1, "ultrafast_config_info: {hashes:?}");
    cmp.text("config:hash", hashes[0]);
    // The engine.
    let e = |f: &str| format!("engine:{MODEL}:{f}");
    cmp.text(&e("ready"), "true");
    if scrape.value("ultrafast_engine_ready", &[("model", MODEL)]) != Some(1.0) {
        cmp.bad.push("ultrafast_engine_ready is not 1".into());
    }
    for state in ["used", "cached", "free"] {
        cmp.count(
            &e(&format!("kv_{state}")),
            scrape.value(
                "ultrafast_engine_kv_blocks",
                &[("model", MODEL), ("state", state)],
            ),
        );
    }
    let by_name = [("model_name", MODEL)];
    cmp.count(
        &e("running"),
        scrape.value("vllm:num_requests_running", &by_name),
    );
    cmp.count(
        &e("waiting"),
        scrape.value("vllm:num_requests_waiting", &by_name),
    );
    cmp.count(
        &e("generation_tokens_total"),
        scrape.value("vllm:generation_tokens_total", &by_name),
    );
    // Each (model, lane): counts exactly, percentiles as Prometheus would
    // compute them from the same buckets (summed over backend).
    for model in [MODEL, "fm"] {
        for lane in ["ultra", "standard"] {
            let want = [("model", model), ("lane", lane)];
            let k = |f: &str| format!("lane:{model}:{lane}:{f}");
            let requests = scrape.sum("ultrafast_inference_requests_total", &want);
            if requests == 0.0 {
                cmp.bad
                    .push(format!("no requests counted for {model} / {lane}"));
            }
            cmp.count(&k("requests_total"), Some(requests));
            for (kind, family) in [
                ("ttft", "ultrafast_inference_ttft_seconds"),
                ("itl", "ultrafast_inference_inter_token_seconds"),
            ] {
                cmp.count(
                    &k(&format!("{kind}_count")),
                    Some(scrape.sum(&format!("{family}_count"), &want)),
                );
                for (p, q) in [("p50", 0.5), ("p90", 0.9), ("p99", 0.99)] {
                    cmp.latency(
                        &k(&format!("{kind}_{p}")),
                        scrape.quantile(family, q, &want),
                    );
                }
            }
        }
    }
    // The pool's member.
    let member = fake.addr.to_string();
    let want = [("pool", "fm-pool"), ("member", member.as_str())];
    let p = |f: &str| format!("pool:fm-pool:{member}:{f}");
    cmp.count(
        &p("in_flight"),
        scrape.value("ultrafast_upstream_member_in_flight", &want),
    );
    let healthy = scrape.value("ultrafast_upstream_member_healthy", &want);
    if healthy != Some(1.0) {
        cmp.bad
            .push(format!("ultrafast_upstream_member_healthy is {healthy:?}"));
    }
    cmp.text(&p("healthy"), "true");
    cmp.count(
        &p("ejections"),
        Some(
            scrape
                .value("ultrafast_upstream_ejections_total", &want)
                .unwrap_or(0.0),
        ),
    );
    assert!(
        cmp.bad.is_empty(),
        "the status page disagrees with /metrics (screenshot {shot}, DOM {html_copy}):\n  {}\npage figures: {figs:#?}",
        cmp.bad.join("\n  ")
    );

    // The exposition with an engine model and traffic on both backends.
    promtool_accepts(&text, &dir);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn every_dashboard_query_answers_in_prometheus() {
    let _one = one_at_a_time();
    // The dashboard first: no point loading a model for a file that is not there.
    let file = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../conf/grafana/ultrafast.json"
    );
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(file).unwrap()).unwrap();
    let mut exprs = Vec::new();
    dashboard_exprs(&dashboard, &mut exprs);
    assert!(exprs.len() >= 20, "few queries in {file}: {exprs:?}");

    let dir = scratch("dashboard");
    let (cert, key) = dev_certs(&dir.join("certs"));
    let origin = Origin::start("web");
    let fm = Fake::start(&[
        "--name",
        "fm",
        "--tokens",
        "8",
        "--ttft-ms",
        "10",
        "--itl-ms",
        "5",
    ]);
    // One slot and one queue place: a burst of eight is mostly shed.
    let slow = Fake::start(&[
        "--name",
        "slow",
        "--tokens",
        "4",
        "--ttft-ms",
        "300",
        "--itl-ms",
        "5",
    ]);
    let tls_port = free_port();
    let body = format!(
        "[[listeners]]\nname = \"https\"\naddress = \"127.0.0.1:{tls_port}\"\n\
         tls = {{ certs = [{{ cert = \"{}\", key = \"{}\", names = [\"localhost\"], default = true }}] }}\n\n\
         {INFERENCE_ROUTE}[[routes]]\nname = \"web\"\npath = \"/web/\"\npool = \"web\"\n\n{}{LANES}{}{}{}",
        cert.display(),
        key.display(),
        pool_toml("web", &[&origin], ""),
        engine_model(),
        upstream_model_in("fm", &[&fm], "", WATCHDOG),
        upstream_model_in("slow", &[&slow], "", "max_concurrency = 1\nmax_queued = 1"),
    );
    let uf = Ultrafast::start(&body);
    uf.wait_models_ready(Duration::from_secs(300));
    assert!(eventually(Duration::from_secs(5), || {
        std::net::TcpStream::connect(("127.0.0.1", tls_port)).is_ok()
    }));
    let prom = Prometheus::start(&dir.join("prometheus"), uf.admin);

    // About 35 s of traffic, so that every 30 s rate has samples; the
    // one-off events come mid-way, inside the windows the queries read.
    let started = Instant::now();
    let (mut shed, mut reloaded, mut refused) = (false, false, false);
    let mut i = 0u32;
    while i < 400 && (started.elapsed() < Duration::from_secs(35) || !(shed && reloaded && refused))
    {
        let lane = i.is_multiple_of(2).then_some("ultra");
        if i.is_multiple_of(2) {
            whole(uf.addr, MODEL, lane, 8);
        } else {
            streamed(uf.addr, MODEL, lane, 8);
        }
        whole(uf.addr, "fm", lane, 8);
        streamed(uf.addr, "fm", lane, 8);
        let r = get(uf.addr, &format!("/web/{i}"), &[]);
        assert_eq!(r.status, 200, "{}", r.text());
        if i % 5 == 1 {
            tls_round(tls_port, i % 2 == 1, &dir);
        }
        let t = started.elapsed();
        if !shed && t >= Duration::from_secs(10) {
            let statuses = burst(uf.addr, "slow", 8);
            assert!(
                uf.metric("ultrafast_admission_shed_total", &[]) >= 1.0,
                "nothing shed: {statuses:?}"
            );
            shed = true;
        }
        if !reloaded && t >= Duration::from_secs(12) {
            uf.write_config(&body);
            let r = uf.reload();
            assert_eq!(r.status, 200, "{}", r.text());
            reloaded = true;
        }
        if !refused && t >= Duration::from_secs(14) {
            refuse_two(uf.addr);
            refused = true;
        }
        i += 1;
        std::thread::sleep(Duration::from_millis(100));
    }
    // Two more scrapes after the last request.
    std::thread::sleep(Duration::from_secs(3));

    // Prometheus scrapes the server at all (else every query below fails
    // for one reason, named here).
    let up = prom.query("up{job=\"ultrafast\"}");
    let up_ok = up.as_ref().is_ok_and(|v| {
        v["data"]["result"]
            .as_array()
            .is_some_and(|r| r.iter().any(|s| s["value"][1] == "1"))
    });
    assert!(
        up_ok,
        "Prometheus does not scrape {}: {up:?}\ntargets: {}\nlog: {}",
        uf.admin,
        prom.raw("/api/v1/targets"),
        tail(&prom.log(), 4000)
    );

    let mut failures = Vec::new();
    let mut nan = Vec::new();
    for (title, expr) in &exprs {
        let q = grafana_vars(expr);
        match prom.query(&q) {
            Err(e) => failures.push(format!("[{title}] {q}\n    {e}")),
            Ok(v) => {
                let result = v["data"]["result"].as_array();
                if v["status"] != "success" || result.is_none_or(|r| r.is_empty()) {
                    failures.push(format!("[{title}] {q}\n    {v}"));
                } else if result
                    .unwrap()
                    .iter()
                    .all(|s| s["value"][1].as_str() == Some("NaN"))
                {
                    nan.push(format!("[{title}] {q}"));
                }
            }
        }
    }
    if !nan.is_empty() {
        // An answer, but nothing to draw: worth a look, not a failure.
        eprintln!("queries answering only NaN:\n  {}", nan.join("\n  "));
    }
    assert!(
        failures.is_empty(),
        "{} of {} dashboard queries have no answer:\n  {}",
        failures.len(),
        exprs.len(),
        failures.join("\n  ")
    );

    // The exposition after all of that, every family populated.
    promtool_accepts(&uf.metrics(), &dir);
    drop(prom);
    let _ = std::fs::remove_dir_all(&dir);
}

// ---------------------------------------------------------------------------
// Helpers.

#[test]
fn with_an_admin_token_the_page_opens_but_its_data_needs_the_token() {
    // Its browsers would take CPU from the timed tests beside it.
    let _one = one_at_a_time();
    let token = "status-page-token-0123456";
    let d = scratch("status-token");
    let (port, admin) = (free_port(), free_port());
    let cfg = d.join("u.toml");
    std::fs::write(
        &cfg,
        format!(
            "[server]\nthreads = 1\npid_file = \"{p}/p\"\nupgrade_sock = \"{p}/s\"\n[log]\naccess_log = \"off\"\n\
             [admin]\nlisten = \"127.0.0.1:{admin}\"\ntoken = \"{token}\"\n\
             [[listeners]]\nname = \"web\"\naddress = \"127.0.0.1:{port}\"\n",
            p = d.display()
        ),
    )
    .unwrap();
    let uf = Ultrafast::spawn(d.clone(), cfg, port, admin, false);
    let page = get(uf.admin, "/status", &[]);
    assert_eq!(page.status, 200, "the page itself is open");
    assert!(page.text().contains("/admin/stats"));
    assert!(page
        .header("content-security-policy")
        .is_some_and(|c| c.contains("default-src 'none'")));
    assert_eq!(get(uf.admin, "/admin/stats", &[]).status, 401);
    let bearer = format!("Bearer {token}");
    let stats = get(
        uf.admin,
        "/admin/stats",
        &[("authorization", bearer.as_str())],
    );
    assert_eq!(stats.status, 200);
    assert!(stats.json()["config"]["hash"].is_string());
    // In a browser: without the token the page says why it has no data;
    // with it in the fragment (never sent to the server) the page renders.
    let without = chromium(
        &d,
        "no-token",
        "--dump-dom",
        &format!("http://{}/status", uf.admin),
    );
    assert_eq!(body_updates(&without.stdout), 0);
    assert!(
        without.stdout.contains("401"),
        "{}",
        tail(&without.stdout, 3000)
    );
    let with = chromium(
        &d,
        "token",
        "--dump-dom",
        &format!("http://{}/status#token={token}", uf.admin),
    );
    assert!(
        body_updates(&with.stdout) >= 2,
        "{}",
        tail(&with.stdout, 3000)
    );
    assert!(with.stdout.contains(r#"data-k="config:hash""#));
}

/// Both tests load the model and time their own windows (the page's last
/// minute, Prometheus's 30 s rates): on two cores they run one at a time.
fn one_at_a_time() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn chat(model: &str, max_tokens: u32, stream: bool) -> String {
    serde_json::json!({"model": model,
        "messages": [{"role": "user", "content": "Say hello to the lighthouse keeper."}],
        "max_tokens": max_tokens, "stream": stream})
    .to_string()
}

/// A whole-response chat completion in `lane` (None: the default lane).
fn whole(addr: SocketAddr, model: &str, lane: Option<&str>, max_tokens: u32) {
    let mut h = vec![("content-type", "application/json")];
    if let Some(l) = lane {
        h.push(("X-Request-Priority", l));
    }
    let r = Client::connect(addr)
        .unwrap()
        .request(
            "POST",
            "/v1/chat/completions",
            &h,
            chat(model, max_tokens, false).as_bytes(),
        )
        .unwrap();
    assert_eq!(r.status, 200, "{model} {lane:?}: {}", r.text());
}

/// A streamed chat completion, read to `[DONE]`.
fn streamed(addr: SocketAddr, model: &str, lane: Option<&str>, max_tokens: u32) {
    let h: Vec<(&str, &str)> = lane
        .map(|l| ("X-Request-Priority", l))
        .into_iter()
        .collect();
    let s = post_stream(
        addr,
        "/v1/chat/completions",
        &chat(model, max_tokens, true),
        &h,
    );
    let (events, _) = read_sse(s, Duration::from_secs(60));
    assert_eq!(
        events.last().map(|e| e.data.as_str()),
        Some("[DONE]"),
        "{model} {lane:?}: {events:?}"
    );
}

/// `n` whole-response requests to `model` at once; their statuses (0: no answer).
fn burst(addr: SocketAddr, model: &str, n: usize) -> Vec<u16> {
    let body = chat(model, 4, false);
    let hs: Vec<_> = (0..n)
        .map(|_| {
            let body = body.clone();
            std::thread::spawn(move || {
                Client::connect(addr)
                    .and_then(|mut c| {
                        c.request(
                            "POST",
                            "/v1/chat/completions",
                            &[("content-type", "application/json")],
                            body.as_bytes(),
                        )
                    })
                    .map_or(0, |r| r.status)
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Two requests refused before they reach a backend, each counted in
/// `ultrafast_downstream_rejected_total`: one no route matches, and one
/// with more headers than `limits.max_headers` (100 by default).
fn refuse_two(addr: SocketAddr) {
    let r = get(addr, "/nowhere", &[]);
    assert_eq!(r.status, 404, "{}", r.text());
    let head: String = (0..150).map(|i| format!("x-h{i}: 1\r\n")).collect();
    let mut c = Client::connect(addr).unwrap();
    c.send_raw(format!("GET /web/many HTTP/1.1\r\nHost: localhost\r\n{head}\r\n").as_bytes())
        .unwrap();
    let r = c.read_response(false).unwrap();
    assert_eq!(r.status, 431, "{}", r.text());
}

/// TLS traffic: a full TLS 1.2 handshake and five resumptions (by ticket,
/// or by the session cache when `no_ticket`), then a request over TLS 1.3.
fn tls_round(port: u16, no_ticket: bool, dir: &Path) {
    let mut cmd = Command::new("openssl");
    cmd.args(["s_client", "-connect"])
        .arg(format!("127.0.0.1:{port}"))
        .args(["-tls1_2", "-servername", "localhost", "-reconnect"]);
    if no_ticket {
        cmd.arg("-no_ticket");
    }
    let ran = run_bounded(&mut cmd, b"", Duration::from_secs(20), dir, NEED_OPENSSL);
    assert!(
        ran.stdout.contains("Reused, TLSv1.2"),
        "no resumption ({:?}): {}{}",
        ran.code,
        tail(&ran.stdout, 3000),
        ran.stderr
    );
    let mut cmd = Command::new("openssl");
    cmd.args(["s_client", "-connect"])
        .arg(format!("127.0.0.1:{port}"))
        .args(["-servername", "localhost", "-ign_eof"]);
    let request = b"GET /web/tls HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";
    let ran = run_bounded(
        &mut cmd,
        request,
        Duration::from_secs(20),
        dir,
        NEED_OPENSSL,
    );
    assert!(
        ran.stdout.contains("HTTP/1.1 200"),
        "no answer over TLS ({:?}): {}{}",
        ran.code,
        tail(&ran.stdout, 3000),
        ran.stderr
    );
}

/// Headless Chromium on `url` with `mode` (`--dump-dom` or
/// `--screenshot=PATH`), its own profile under `dir`, bounded to 60 s.
/// Virtual time lets the page's one-second polls run eight times without
/// eight seconds of waiting (fetches still happen for real).
fn chromium(dir: &Path, tag: &str, mode: &str, url: &str) -> Ran {
    let profile = dir.join(format!("profile-{tag}"));
    let mut cmd = Command::new("chromium");
    cmd.args([
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        "--no-first-run",
        "--no-default-browser-check",
        "--no-proxy-server",
        "--disable-dev-shm-usage",
    ])
    .arg(format!("--user-data-dir={}", profile.display()))
    .args(["--virtual-time-budget=8000", "--window-size=1280,2600"])
    .arg(mode)
    .arg(url);
    let ran = run_bounded(&mut cmd, b"", Duration::from_secs(60), dir, NEED_CHROMIUM);
    assert!(
        !ran.timed_out,
        "chromium {mode} ran past 60 s: {}",
        tail(&ran.stderr, 4000)
    );
    ran
}

/// Pipe `text` into `promtool check metrics`. The one problem allowed is
/// promtool's lint against colons in names, for the `vllm:*` families:
/// those keep vLLM's names on purpose, so tools built for vLLM read them.
fn promtool_accepts(text: &str, dir: &Path) {
    assert!(
        text.contains("vllm:num_requests_running"),
        "no vllm:* family to check:\n{text}"
    );
    let mut cmd = Command::new("promtool");
    cmd.args(["check", "metrics"]);
    let ran = run_bounded(
        &mut cmd,
        text.as_bytes(),
        Duration::from_secs(60),
        dir,
        NEED_PROMTOOL,
    );
    let report = format!("{}{}", ran.stdout, ran.stderr);
    let colon = Regex::new(r"^vllm:[a-z0-9_:]+ metric names should not contain ':'$").unwrap();
    let unexpected: Vec<&str> = report
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !colon.is_match(l))
        .collect();
    // promtool exits 3 when it reports lint problems.
    let exit_ok = ran.code == Some(0) || (ran.code == Some(3) && !report.trim().is_empty());
    assert!(
        exit_ok && unexpected.is_empty(),
        "promtool ({:?}):\n{report}",
        ran.code
    );
}

/// What a bounded run of a tool printed and how it ended.
struct Ran {
    code: Option<i32>,
    timed_out: bool,
    stdout: String,
    stderr: String,
}

/// Run `cmd` with `stdin`, output into files under `dir` (no pipe to fill
/// up), killed with its whole process group (Chromium's helpers too) after
/// `limit`. A tool that is not installed panics with `need`.
fn run_bounded(cmd: &mut Command, stdin: &[u8], limit: Duration, dir: &Path, need: &str) -> Ran {
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::SeqCst);
    std::fs::create_dir_all(dir).unwrap();
    let (out, err) = (
        dir.join(format!("run-{n}.out")),
        dir.join(format!("run-{n}.err")),
    );
    cmd.stdin(if stdin.is_empty() {
        Stdio::null()
    } else {
        Stdio::piped()
    })
    .stdout(std::fs::File::create(&out).unwrap())
    .stderr(std::fs::File::create(&err).unwrap())
    .process_group(0);
    let mut child = cmd.spawn().unwrap_or_else(|e| panic!("{need}: {e}"));
    // Written from a thread: a child that does not read cannot block us
    // past the deadline (its exit breaks the pipe).
    let writer = child.stdin.take().map(|mut w| {
        let data = stdin.to_vec();
        std::thread::spawn(move || {
            let _ = w.write_all(&data);
        })
    });
    let deadline = Instant::now() + limit;
    let (code, timed_out) = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break (status.code(), false);
        }
        if Instant::now() >= deadline {
            // The group is ours while its leader, our child, is unreaped.
            let _ = Command::new("kill")
                .args(["-KILL", "--"])
                .arg(format!("-{}", child.id()))
                .status();
            let _ = child.kill();
            let _ = child.wait();
            break (None, true);
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    if let Some(w) = writer {
        let _ = w.join();
    }
    let read =
        |p: &Path| String::from_utf8_lossy(&std::fs::read(p).unwrap_or_default()).into_owned();
    Ran {
        code,
        timed_out,
        stdout: read(&out),
        stderr: read(&err),
    }
}

/// A Prometheus server scraping one target every second, stopped (by its
/// handle) when dropped.
struct Prometheus {
    child: Child,
    addr: SocketAddr,
    log: PathBuf,
}

impl Prometheus {
    fn start(dir: &Path, target: SocketAddr) -> Prometheus {
        std::fs::create_dir_all(dir).unwrap();
        let cfg = dir.join("prometheus.yml");
        std::fs::write(
            &cfg,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
                 scrape_configs:\n  - job_name: ultrafast\n    metrics_path: /metrics\n    \
                 static_configs:\n      - targets: [\"{target}\"]\n"
            ),
        )
        .unwrap();
        let port = free_port();
        let log = dir.join("prometheus.log");
        let file = std::fs::File::create(&log).unwrap();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", cfg.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("tsdb").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdin(Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .unwrap_or_else(|e| panic!("{NEED_PROMETHEUS}: {e}"));
        let mut p = Prometheus {
            child,
            addr: format!("127.0.0.1:{port}").parse().unwrap(),
            log,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(st) = p.child.try_wait().unwrap() {
                panic!("prometheus exited ({st}): {}", tail(&p.log(), 4000));
            }
            let ready = Client::connect(p.addr)
                .and_then(|mut c| c.request("GET", "/-/ready", &[], b""))
                .is_ok_and(|r| r.status == 200);
            if ready {
                return p;
            }
            assert!(
                Instant::now() < deadline,
                "prometheus not ready in 60 s: {}",
                tail(&p.log(), 4000)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The body of a GET, or why there is none.
    fn raw(&self, path: &str) -> String {
        match Client::connect(self.addr).and_then(|mut c| c.request("GET", path, &[], b"")) {
            Ok(r) => r.text(),
            Err(e) => format!("({e})"),
        }
    }

    /// An instant query's answer (Prometheus answers errors in JSON too).
    fn query(&self, expr: &str) -> Result<serde_json::Value, String> {
        let path = format!("/api/v1/query?query={}", escape(expr));
        let r = Client::connect(self.addr)
            .and_then(|mut c| c.request("GET", &path, &[], b""))
            .map_err(|e| format!("no answer: {e}"))?;
        serde_json::from_slice(&r.body)
            .map_err(|e| format!("HTTP {}, not JSON ({e}): {}", r.status, r.text()))
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Every `targets[].expr` of the dashboard with its panel's title, panels
/// nested in rows included.
fn dashboard_exprs(v: &serde_json::Value, out: &mut Vec<(String, String)>) {
    for p in v["panels"].as_array().into_iter().flatten() {
        let title = p["title"].as_str().unwrap_or("?").to_string();
        for t in p["targets"].as_array().into_iter().flatten() {
            if let Some(e) = t["expr"].as_str() {
                out.push((title.clone(), e.to_string()));
            }
        }
        // A collapsed row holds its panels.
        dashboard_exprs(p, out);
    }
}

/// Grafana's built-in interval variables, as Grafana would fill them in
/// for a short range; any other `$variable` is left for Prometheus to refuse.
fn grafana_vars(expr: &str) -> String {
    expr.replace("${__rate_interval}", "30s")
        .replace("$__rate_interval", "30s")
        .replace("${__interval}", "5s")
        .replace("$__interval", "5s")
        .replace("${__range}", "5m")
        .replace("$__range", "5m")
}

/// One sample of the Prometheus text format.
#[derive(Debug, Clone)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// A parsed `/metrics` answer (`uf.metric` sums lines; the comparisons
/// need labels and buckets).
struct Scrape {
    samples: Vec<Sample>,
}

impl Scrape {
    fn parse(text: &str) -> Scrape {
        Scrape {
            samples: text.lines().filter_map(parse_sample).collect(),
        }
    }

    /// The samples of `name` whose labels include `want`.
    fn series(&self, name: &str, want: &[(&str, &str)]) -> Vec<&Sample> {
        self.samples
            .iter()
            .filter(|s| s.name == name)
            .filter(|s| {
                want.iter()
                    .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
            })
            .collect()
    }

    fn sum(&self, name: &str, want: &[(&str, &str)]) -> f64 {
        self.series(name, want).iter().map(|s| s.value).sum()
    }

    /// The sum, or None when no series matches.
    fn value(&self, name: &str, want: &[(&str, &str)]) -> Option<f64> {
        let s = self.series(name, want);
        (!s.is_empty()).then(|| s.iter().map(|s| s.value).sum())
    }

    /// `histogram_quantile(q, sum by (le) (family_bucket{want}))`.
    fn quantile(&self, family: &str, q: f64, want: &[(&str, &str)]) -> Option<f64> {
        let mut buckets: Vec<(f64, f64)> = Vec::new();
        for s in self.series(&format!("{family}_bucket"), want) {
            let Some(le) = s.labels.get("le").and_then(|l| parse_value(l)) else {
                continue;
            };
            match buckets.iter_mut().find(|b| b.0 == le) {
                Some(b) => b.1 += s.value,
                None => buckets.push((le, s.value)),
            }
        }
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        histogram_quantile(q, &buckets)
    }
}

/// Prometheus's `histogram_quantile` over cumulative (upper bound, count)
/// buckets sorted by bound, `+Inf` last: the first bucket whose count
/// reaches `q` of the total, linear within it from the bound before (0 for
/// the first bucket); in the `+Inf` bucket, the highest finite bound. None
/// where Prometheus gives NaN (no samples, no `+Inf` bucket).
fn histogram_quantile(q: f64, buckets: &[(f64, f64)]) -> Option<f64> {
    let last = buckets.last()?;
    if buckets.len() < 2 || last.0 != f64::INFINITY || last.1 == 0.0 {
        return None;
    }
    let rank = q * last.1;
    let b = buckets.iter().position(|(_, c)| *c >= rank)?;
    if b == buckets.len() - 1 {
        return Some(buckets[b - 1].0);
    }
    if b == 0 && buckets[0].0 <= 0.0 {
        return Some(buckets[0].0);
    }
    let (start, before) = if b == 0 { (0.0, 0.0) } else { buckets[b - 1] };
    let (end, count) = buckets[b];
    Some(start + (end - start) * (rank - before) / (count - before))
}

fn parse_value(v: &str) -> Option<f64> {
    match v {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        _ => v.parse().ok(),
    }
}

/// `name{k="v",...} value [timestamp]`; None for comments and blank lines.
fn parse_sample(line: &str) -> Option<Sample> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let end = line.find(|c: char| c == '{' || c.is_whitespace())?;
    let name = line[..end].to_string();
    let mut labels = BTreeMap::new();
    let mut rest = &line[end..];
    if let Some(body) = rest.strip_prefix('{') {
        let b = body.as_bytes();
        let mut i = 0;
        loop {
            while i < b.len() && (b[i] == b',' || b[i] == b' ') {
                i += 1;
            }
            if *b.get(i)? == b'}' {
                i += 1;
                break;
            }
            let eq = i + body[i..].find('=')?;
            let key = body[i..eq].trim().to_string();
            i = eq + 1;
            if b.get(i) != Some(&b'"') {
                return None;
            }
            i += 1;
            let mut val = Vec::new();
            loop {
                match *b.get(i)? {
                    b'\\' => {
                        val.push(match *b.get(i + 1)? {
                            b'n' => b'\n',
                            c => c,
                        });
                        i += 2;
                    }
                    b'"' => {
                        i += 1;
                        break;
                    }
                    c => {
                        val.push(c);
                        i += 1;
                    }
                }
            }
            labels.insert(key, String::from_utf8_lossy(&val).into_owned());
        }
        rest = &body[i..];
    }
    let value = parse_value(rest.split_whitespace().next()?)?;
    Some(Sample {
        name,
        labels,
        value,
    })
}

/// Every `data-k` / `data-v` pair of the serialized DOM, whatever the
/// attribute order within a tag.
fn figures(dom: &str) -> BTreeMap<String, String> {
    let tag = Regex::new(r"<[A-Za-z][^>]*>").unwrap();
    let k = Regex::new(r#"\sdata-k="([^"]*)""#).unwrap();
    let v = Regex::new(r#"\sdata-v="([^"]*)""#).unwrap();
    let mut out = BTreeMap::new();
    for t in tag.find_iter(dom) {
        let t = t.as_str();
        if let (Some(k), Some(v)) = (k.captures(t), v.captures(t)) {
            out.insert(html_unescape(&k[1]), html_unescape(&v[1]));
        }
    }
    out
}

/// Each plot's key and number of points (`data-plot`, `data-points`).
fn plot_points(dom: &str) -> Vec<(String, u64)> {
    let tag = Regex::new(r"<[A-Za-z][^>]*>").unwrap();
    let plot = Regex::new(r#"\sdata-plot="([^"]*)""#).unwrap();
    let points = Regex::new(r#"\sdata-points="(\d+)""#).unwrap();
    tag.find_iter(dom)
        .filter_map(|t| {
            let t = t.as_str();
            let p = plot.captures(t)?;
            let n = points.captures(t)?;
            Some((html_unescape(&p[1]), n[1].parse().ok()?))
        })
        .collect()
}

/// The body's `data-updates`: renders of a successful poll.
fn body_updates(dom: &str) -> u64 {
    Regex::new(r#"<body\b[^>]*\sdata-updates="(\d+)""#)
        .unwrap()
        .captures(dom)
        .and_then(|c| c[1].parse().ok())
        .unwrap_or(0)
}

fn html_unescape(s: &str) -> String {
    s.replace("&quot;", "\"")
        .replace("&#39;", "'")
        .replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&nbsp;", "\u{a0}")
        .replace("&amp;", "&")
}

/// Page figures against metric values, collecting every disagreement.
struct Compare<'a> {
    figs: &'a BTreeMap<String, String>,
    bad: Vec<String>,
}

impl<'a> Compare<'a> {
    fn page(&mut self, key: &str) -> Option<&'a str> {
        let figs: &'a BTreeMap<String, String> = self.figs;
        let v = figs.get(key).map(String::as_str);
        if v.is_none() {
            self.bad.push(format!("{key}: not on the page"));
        }
        v
    }

    fn text(&mut self, key: &str, want: &str) {
        if let Some(v) = self.page(key) {
            if v != want {
                self.bad
                    .push(format!("{key}: page {v:?}, metrics {want:?}"));
            }
        }
    }

    /// A number (`null` on the page is None) within `close` of `want`.
    fn number(&mut self, key: &str, want: Option<f64>, close: fn(f64, f64) -> bool) {
        let Some(v) = self.page(key) else { return };
        let got = if v == "null" {
            None
        } else if let Ok(x) = v.parse::<f64>() {
            Some(x)
        } else {
            self.bad.push(format!("{key}: page {v:?} is not a number"));
            return;
        };
        let agree = match (got, want) {
            (None, None) => true,
            (Some(g), Some(w)) => close(g, w),
            _ => false,
        };
        if !agree {
            self.bad.push(format!("{key}: page {v}, metrics {want:?}"));
        }
    }

    fn count(&mut self, key: &str, want: Option<f64>) {
        self.number(key, want, |g: f64, w: f64| (g - w).abs() < 1e-6);
    }

    /// Within 2 % or half a millisecond.
    fn latency(&mut self, key: &str, want: Option<f64>) {
        self.number(key, want, |g: f64, w: f64| {
            (g - w).abs() <= (0.02 * w.abs()).max(0.0005)
        });
    }
}

fn tail(s: &str, n: usize) -> &str {
    let mut from = s.len().saturating_sub(n);
    while !s.is_char_boundary(from) {
        from += 1;
    }
    &s[from..]
}
