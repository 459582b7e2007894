//! `lb = "predicted_latency"` in front of the fleet simulator's live
//! replicas (`fleet-sim serve`: continuous-batching step models streaming
//! real SSE, vLLM's metric names): requests go to the member with the
//! most headroom, a shared prefix goes back to its member, a member that
//! turns slow loses its traffic, a drained member finishes its streams and
//! gets no new ones, and the SLO headers tighten a request's targets
//! within what its key allows. The simulator's discrete-event mode is
//! tested in `benches/tests/fleet.rs`.
#![allow(clippy::unwrap_used)]

mod common;
use common::infer::*;
use common::*;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// `fleet-sim serve` with these speeds.
struct Sim {
    child: Child,
    addrs: Vec<SocketAddr>,
}

impl Sim {
    fn start(speeds: &str) -> Sim {
        let mut child = Command::new(bench_bin("fleet-sim"))
            .args(["serve", "--speeds", speeds])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.take().unwrap()),
            &mut line,
        )
        .unwrap();
        let addrs = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap()
            .split(',')
            .map(|a| a.parse().unwrap())
            .collect();
        Sim { child, addrs }
    }

    fn requests(&self) -> Vec<u64> {
        self.addrs
            .iter()
            .map(|a| get(*a, "/stats", &[]).json()["requests"].as_u64().unwrap())
            .collect()
    }

    fn stat(&self, i: usize, k: &str) -> u64 {
        get(self.addrs[i], "/stats", &[]).json()[k]
            .as_u64()
            .unwrap()
    }

    fn speed(&self, i: usize, s: f64) {
        let mut c = Client::connect(self.addrs[i]).unwrap();
        let body = format!("{{\"speed\": {s}}}");
        let r = c
            .request(
                "POST",
                "/control",
                &[("content-type", "application/json")],
                body.as_bytes(),
            )
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The pool over `members` (indices into the sim's) and model `m`.
fn fleet_toml(sim: &Sim, members: &[usize], extra: &str) -> String {
    let list: Vec<String> = members
        .iter()
        .map(|&i| format!("{{ addr = \"{}\" }}", sim.addrs[i]))
        .collect();
    format!(
        "{INFERENCE_ROUTE}[pools.fleet]\nmembers = [{}]\nlb = \"predicted_latency\"\nmember_slots = 16\nmember_chunk_tokens = 512\nscrape_interval_ms = 100\n\n\
         [models.m]\nbackend = \"upstream\"\npool = \"fleet\"\nupstream_model = \"sim\"\nprefill_tokens_per_s = 10000\ndecode_tokens_per_s = 95\n{extra}\n",
        list.join(", ")
    )
}

fn chat_body(system: &str, user: &str, max_tokens: usize) -> String {
    serde_json::json!({
        "model": "m", "stream": true, "max_tokens": max_tokens,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    })
    .to_string()
}

/// One streamed chat to its end; its status and content pieces.
fn chat(uf: &Ultrafast, body: &str, headers: &[(&str, &str)]) -> (u16, usize) {
    let mut c = Client::connect(uf.addr).unwrap();
    let mut h = vec![("content-type", "application/json")];
    h.extend_from_slice(headers);
    let r = c
        .request("POST", "/v1/chat/completions", &h, body.as_bytes())
        .unwrap();
    let n = r
        .text()
        .lines()
        .filter(|l| l.starts_with("data: {") && l.contains("\"content\""))
        .count();
    (r.status, n)
}

fn delta(after: &[u64], before: &[u64]) -> Vec<u64> {
    after.iter().zip(before).map(|(a, b)| a - b).collect()
}

#[test]
fn traffic_follows_headroom_and_leaves_a_member_that_turns_slow() {
    let sim = Sim::start("1,1,1");
    let uf = Ultrafast::start(&fleet_toml(&sim, &[0, 1, 2], ""));
    uf.wait_models_ready(Duration::from_secs(10));
    // Distinct conversations (no shared prefix), a few at a time, so every
    // member streams and each one's model learns its speed.
    let warm = |n: usize, tag: &str| {
        std::thread::scope(|s| {
            for t in 0..3 {
                let uf = &uf;
                s.spawn(move || {
                    for i in 0..n {
                        let body = chat_body(&format!("{tag} {t} {i}"), "hello", 24);
                        let (st, toks) = chat(uf, &body, &[]);
                        assert_eq!(st, 200);
                        assert_eq!(toks, 24);
                    }
                });
            }
        })
    };
    warm(8, "warm");
    // Member 0 turns ten times slower: once its streams show it, new
    // requests go elsewhere.
    sim.speed(0, 0.1);
    warm(4, "learn");
    let before = sim.requests();
    warm(6, "after");
    let d = delta(&sim.requests(), &before);
    assert!(
        d[0] * 4 < d[1] + d[2],
        "the slow member still gets its share: {d:?}"
    );
    assert!(d[1] > 0 && d[2] > 0, "{d:?}");
}

#[test]
fn a_shared_prefix_returns_to_its_member_and_a_drained_member_finishes_its_streams() {
    let sim = Sim::start("1,1,1,1");
    let uf = Ultrafast::start(&fleet_toml(&sim, &[0, 1, 2, 3], ""));
    uf.wait_models_ready(Duration::from_secs(10));
    let system = "You answer questions about the attached 40-page manual. ".repeat(40);
    let before = sim.requests();
    for i in 0..8 {
        let (st, _) = chat(&uf, &chat_body(&system, &format!("question {i}"), 4), &[]);
        assert_eq!(st, 200);
    }
    let d = delta(&sim.requests(), &before);
    let home = d.iter().position(|&n| n == 8);
    assert!(home.is_some(), "the conversation was spread: {d:?}");
    let home = home.unwrap();
    // A long stream on the home member, then the member is drained (the
    // pool reloaded without it): the stream finishes, nothing new goes there.
    let body = chat_body(&system, "a long answer please", 300);
    let before = sim.requests();
    let s = post_stream(uf.addr, "/v1/chat/completions", &body, &[]);
    assert!(
        eventually(Duration::from_secs(5), || sim.stat(home, "active") == 1),
        "the long stream went elsewhere: {:?} (home {home})",
        delta(&sim.requests(), &before)
    );
    let rest: Vec<usize> = (0..4).filter(|&i| i != home).collect();
    uf.write_config(&fleet_toml(&sim, &rest, ""));
    assert_eq!(uf.reload().status, 200);
    let before = sim.requests();
    for i in 0..6 {
        let (st, _) = chat(&uf, &chat_body(&system, &format!("after {i}"), 4), &[]);
        assert_eq!(st, 200);
    }
    let d = delta(&sim.requests(), &before);
    assert_eq!(d[home], 0, "a drained member got new requests: {d:?}");
    let (evs, _) = read_sse(s, Duration::from_secs(30));
    assert_eq!(
        contents(&evs).len(),
        300,
        "the drained member's stream did not finish"
    );
    assert_eq!(sim.stat(home, "cancelled"), 0);
}

#[test]
fn slo_headers_tighten_within_what_the_key_allows() {
    let sim = Sim::start("1,1");
    let dir = scratch("fleet-keys");
    let keys = dir.join("keys.toml");
    std::fs::write(
        &keys,
        "[[keys]]\nname = \"floor\"\nkey = \"sk-floor\"\nmin_ttft_ms = 5000\n\n[[keys]]\nname = \"free\"\nkey = \"sk-free\"\n",
    )
    .unwrap();
    let head = format!("[api_keys]\nfile = \"{}\"\n\n", keys.display());
    let uf = Ultrafast::start(&format!("{head}{}", fleet_toml(&sim, &[0, 1], "")));
    uf.wait_models_ready(Duration::from_secs(10));
    let long = "words of a long prompt ".repeat(400);
    let body = chat_body(&long, "q", 4);
    // Another long prompt (the first one's prefix is cached where it went,
    // so it could start within 20 ms there).
    let other = chat_body(&"other words, other prompt ".repeat(400), "q", 4);
    let free = [("authorization", "Bearer sk-free")];
    let (st, _) = chat(&uf, &body, &free);
    assert_eq!(st, 200);
    // Its own 20 ms target: ~2,300 prompt tokens cannot start that soon
    // even on an idle member.
    let mut c = Client::connect(uf.addr).unwrap();
    let r = c
        .request(
            "POST",
            "/v1/chat/completions",
            &[
                ("content-type", "application/json"),
                free[0],
                ("x-slo-ttft-ms", "20"),
            ],
            other.as_bytes(),
        )
        .unwrap();
    assert_eq!(r.status, 422, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "slo_unattainable");
    // llm-d's name is an alias; a key with a 5 s floor cannot ask for 20 ms.
    let floor = [
        ("authorization", "Bearer sk-floor"),
        ("x-llm-d-slo-ttft-ms", "20"),
    ];
    let r = Client::connect(uf.addr)
        .unwrap()
        .request(
            "POST",
            "/v1/chat/completions",
            &[("content-type", "application/json"), floor[0], floor[1]],
            body.as_bytes(),
        )
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let predicted: u64 = r
        .header("x-ultrafast-predicted-ttft-ms")
        .unwrap()
        .parse()
        .unwrap();
    assert!(predicted <= 5000, "{predicted}");
    // An inter-token target no member meets: refused now, with Retry-After.
    let r = Client::connect(uf.addr)
        .unwrap()
        .request(
            "POST",
            "/v1/chat/completions",
            &[
                ("content-type", "application/json"),
                free[0],
                ("x-slo-tpot-ms", "1"),
            ],
            chat_body("short", "q", 4).as_bytes(),
        )
        .unwrap();
    assert_eq!(r.status, 503, "{}", r.text());
    assert!(r.header("retry-after").is_some());
    // A malformed value is the client's error, named.
    let r = Client::connect(uf.addr)
        .unwrap()
        .request(
            "POST",
            "/v1/chat/completions",
            &[
                ("content-type", "application/json"),
                free[0],
                ("x-slo-ttft-ms", "soon"),
            ],
            chat_body("short", "q", 4).as_bytes(),
        )
        .unwrap();
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["param"], "x-slo-ttft-ms");
}
