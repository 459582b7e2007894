//! API keys, token budgets and limits on every `/v1/` endpoint, over a pool
//! of fake OpenAI upstreams (the real protocol): the official `openai`
//! client's view of 401/403/429, reservations refunded to real usage, a
//! budget held by a running request, the key file reloaded live (a bad one
//! keeps the old keys), async requests visible to their tenant only, and
//! the size admission reserved sent upstream.
#![allow(clippy::unwrap_used)]

mod common;
use common::infer::*;
use common::*;
use std::io::{BufRead, BufReader};
use std::time::Duration;

const KEYS: &str = r#"
[[keys]]
name = "alpha"
key = "sk-alpha"
models = ["m"]
tokens_per_min = 60
burst_tokens = 100

[[keys]]
name = "beta"
key = "sk-beta"
"#;

fn start(fake: &Fake, keys: &str, extra: &str) -> (Ultrafast, std::path::PathBuf) {
    let dir = scratch("keys");
    let file = dir.join("keys.toml");
    std::fs::write(&file, keys).unwrap();
    let uf = Ultrafast::start(&format!(
        "[api_keys]\nfile = \"{}\"\nwatch_interval_ms = 100\n\n{extra}{INFERENCE_ROUTE}{}{}",
        file.display(),
        upstream_model("m", &[fake], ""),
        upstream_model("other", &[fake], ""),
    ));
    (uf, file)
}

fn chat(model: &str, max_tokens: Option<u32>, stream: bool) -> String {
    let mut v = serde_json::json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream});
    if let Some(m) = max_tokens {
        v["max_tokens"] = m.into();
    }
    v.to_string()
}

#[test]
fn keys_and_token_budgets_through_the_openai_client() {
    let fake = Fake::start(&["--tokens", "8", "--itl-ms", "1"]);
    let (uf, _) = start(&fake, KEYS, "");
    python_check("keys", &uf, "m");
    // Without a key, every /v1/ endpoint is a 401 in OpenAI's shape.
    for path in ["/v1/models", "/v1/requests/req_x"] {
        let r = get(uf.addr, path, &[]);
        assert_eq!(r.status, 401, "{path}: {}", r.text());
        assert_eq!(r.json()["error"]["code"], "invalid_api_key");
        assert!(r.header("www-authenticate").is_some());
    }
    // Beta has no allow-list and no budget.
    let r = post_as(&uf, "sk-beta", &chat("other", Some(5), false), &[]);
    assert_eq!(r.status, 200, "{}", r.text());
}

#[test]
fn a_running_request_holds_its_reservation_until_it_ends() {
    // Slow tokens: the first request is still running when the second comes.
    let fake = Fake::start(&["--tokens", "20", "--itl-ms", "100"]);
    let (uf, _) = start(&fake, KEYS, "");
    let s = post_stream(
        uf.addr,
        "/v1/chat/completions",
        &chat("m", Some(80), true),
        &[("Authorization", "Bearer sk-alpha")],
    );
    let mut r = BufReader::new(s);
    let mut line = String::new();
    while !line.starts_with("data:") {
        line.clear();
        r.read_line(&mut line).unwrap();
    }
    let refused = post_as(&uf, "sk-alpha", &chat("m", Some(80), false), &[]);
    assert_eq!(refused.status, 429, "{}", refused.text());
    assert_eq!(refused.header("x-ultrafast-shed"), Some("token_budget"));
    let wait: u64 = refused.header("retry-after").unwrap().parse().unwrap();
    assert!(wait >= 1);
    assert_eq!(refused.json()["error"]["code"], "token_budget");
    // Beta's work is not alpha's budget.
    assert_eq!(
        post_as(&uf, "sk-beta", &chat("m", Some(80), false), &[]).status,
        200
    );
    // Once the first ends it is settled to what it used (about 25 tokens).
    while r.read_line(&mut line).unwrap_or(0) > 0 && !line.contains("[DONE]") {
        line.clear();
    }
    assert!(eventually(Duration::from_secs(5), || post_as(
        &uf,
        "sk-alpha",
        &chat("m", Some(60), false),
        &[]
    )
    .status
        == 200));
}

#[test]
fn the_key_file_reloads_live_and_a_bad_one_keeps_the_old_keys() {
    let fake = Fake::start(&["--tokens", "4", "--itl-ms", "1"]);
    let (uf, file) = start(&fake, KEYS, "");
    assert_eq!(get_as(&uf, "sk-gamma", "/v1/models").status, 401);
    std::fs::write(
        &file,
        format!("{KEYS}\n[[keys]]\nname = \"gamma\"\nkey = \"sk-gamma\"\n"),
    )
    .unwrap();
    assert!(
        eventually(Duration::from_secs(5), || get_as(
            &uf,
            "sk-gamma",
            "/v1/models"
        )
        .status
            == 200),
        "{}",
        uf.stderr()
    );
    // A malformed file: the error names the file, the line and the field;
    // every key keeps working.
    std::fs::write(
        &file,
        format!("{KEYS}\n[[keys]]\nname = \"delta\"\nkee = \"x\"\n"),
    )
    .unwrap();
    assert!(
        eventually(Duration::from_secs(5), || uf.stderr().contains("kee")),
        "{}",
        uf.stderr()
    );
    let log = uf.stderr();
    assert!(log.contains("keys.toml:"), "{log}");
    assert_eq!(get_as(&uf, "sk-gamma", "/v1/models").status, 200);
    assert_eq!(get_as(&uf, "sk-alpha", "/v1/models").status, 200);
}

#[test]
fn rate_limits_cover_every_v1_endpoint_before_any_work() {
    let fake = Fake::start(&["--tokens", "4", "--itl-ms", "1"]);
    let uf = Ultrafast::start(&format!(
        "[rate_limits.ip]\nkey = \"client_ip\"\nrate_per_s = 0.01\nburst = 2\n\n\
         [[routes]]\nname = \"openai\"\npath = \"/v1/\"\ninference = true\nrate_limits = [\"ip\"]\n\n{}",
        upstream_model("m", &[&fake], "")
    ));
    assert_eq!(uf.get("/v1/models").status, 200);
    assert_eq!(uf.get("/v1/requests/req_unknown").status, 404);
    let r = uf.get("/v1/models");
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "rate_limit");
    assert!(r.header("retry-after").is_some());
    // A completion is refused before its body is even parsed.
    let r = Client::connect(uf.addr)
        .unwrap()
        .request("POST", "/v1/chat/completions", &[], b"{not json")
        .unwrap();
    assert_eq!(r.status, 429, "{}", r.text());
}

#[test]
fn async_requests_are_visible_to_their_tenant_only() {
    let fake = Fake::start(&["--tokens", "4", "--itl-ms", "1"]);
    let (uf, _) = start(&fake, KEYS, "");
    let r = post_as(
        &uf,
        "sk-beta",
        &chat("m", Some(4), false),
        &[("Prefer", "respond-async"), ("X-Request-Id", "victim-123")],
    );
    assert_eq!(r.status, 202, "{}", r.text());
    let id = r.json()["id"].as_str().unwrap().to_string();
    assert!(!id.contains("victim"), "the id is not the client's: {id}");
    assert!(eventually(Duration::from_secs(5), || get_as(
        &uf,
        "sk-beta",
        &format!("/v1/requests/{id}")
    )
    .json()["status"]
        == "completed"));
    for path in [
        format!("/v1/requests/{id}"),
        format!("/v1/requests/{id}/events"),
    ] {
        assert_eq!(get_as(&uf, "sk-alpha", &path).status, 404, "{path}");
    }
    let del = Client::connect(uf.addr)
        .unwrap()
        .request(
            "DELETE",
            &format!("/v1/requests/{id}"),
            &[("Authorization", "Bearer sk-alpha")],
            b"",
        )
        .unwrap();
    assert_eq!(del.status, 404);
}

#[test]
fn upstreams_get_the_size_admission_reserved() {
    let fake = Fake::start(&["--tokens", "4", "--itl-ms", "1"]);
    let uf = Ultrafast::start(&format!(
        "{INFERENCE_ROUTE}{}",
        upstream_model("m", &[&fake], "")
    ));
    let r = Client::connect(uf.addr)
        .unwrap()
        .request(
            "POST",
            "/v1/chat/completions",
            &[("Content-Type", "application/json")],
            chat("m", None, false).as_bytes(),
        )
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(fake.stats()["last_body"]["max_tokens"], 256);
}
