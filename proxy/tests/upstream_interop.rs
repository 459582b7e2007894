//! Upstream pools that work with the servers users run: UUIDv7 request ids
//! (a fake upstream that refuses any other id with an empty 400, as
//! llama-cpp-python's server does), the per-pool `request_id` policy on
//! both the inference and the proxy path, upstream errors that say what
//! the server said, and per-server dialects (fields sent, health path).
#![allow(clippy::unwrap_used)]

mod common;
use common::infer::*;
use common::*;
use std::time::Duration;
use ultrafast::reqid::is_uuid;

fn chat(extra: &str, headers: &[(&str, &str)], uf: &Ultrafast) -> Resp {
    let body = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}],"max_tokens":4{extra}}}"#
    );
    Client::connect(uf.addr)
        .unwrap()
        .request("POST", "/v1/chat/completions", headers, body.as_bytes())
        .unwrap()
}

#[test]
fn a_server_that_takes_only_uuid_request_ids_serves_every_request() {
    let fake = Fake::start(&[
        "--tokens",
        "400",
        "--itl-ms",
        "2",
        "--ttft-ms",
        "5",
        "--uuid-request-ids",
    ]);
    let uf = Ultrafast::start(&format!(
        "{INFERENCE_ROUTE}{}",
        upstream_model("m", &[&fake], "")
    ));
    // Our own id: a UUIDv7, the same in the response and upstream.
    let r = chat("", &[], &uf);
    assert_eq!(r.status, 200, "{}", r.text());
    let id = r.header("x-request-id").unwrap().to_string();
    assert!(is_uuid(&id) && &id[14..15] == "7", "{id}");
    assert_eq!(fake.stats()["last_request_id"], id.as_str());
    assert!(r.json()["id"].as_str().unwrap().contains(&id));
    // A client's id that is not a UUID stays the client's, and the server
    // gets a fresh UUID.
    let r = chat("", &[("x-request-id", "my-trace-1")], &uf);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-request-id"), Some("my-trace-1"));
    let sent = fake.stats()["last_request_id"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(is_uuid(&sent), "{sent}");
    // A client's UUID is forwarded as it is.
    let theirs = "123e4567-e89b-42d3-a456-426614174000";
    assert_eq!(chat("", &[("x-request-id", theirs)], &uf).status, 200);
    assert_eq!(fake.stats()["last_request_id"], theirs);
    // Streams and the official client too.
    let s = post_stream(
        uf.addr,
        "/v1/chat/completions",
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":4,"stream":true}"#,
        &[("x-request-id", "not-a-uuid")],
    );
    let (evs, _) = read_sse(s, Duration::from_secs(10));
    assert_eq!(evs.last().unwrap().data, "[DONE]");
    assert_eq!(contents(&evs).len(), 4);
    python_check("basics", &uf, "m");
    assert_eq!(fake.stat("failed"), 0, "no request was refused upstream");
}

#[test]
fn request_id_none_sends_no_header_and_uuid_always_a_fresh_one() {
    let fake = Fake::start(&["--tokens", "2", "--uuid-request-ids"]);
    let theirs = "123e4567-e89b-42d3-a456-426614174000";
    let uf = Ultrafast::start(&format!(
        "{INFERENCE_ROUTE}{}",
        upstream_model_in("m", &[&fake], "request_id = \"none\"", "")
    ));
    assert_eq!(chat("", &[("x-request-id", theirs)], &uf).status, 200);
    assert!(fake.stats()["last_request_id"].is_null());
    uf.write_config(&format!(
        "{INFERENCE_ROUTE}{}",
        upstream_model_in("m", &[&fake], "request_id = \"uuid\"", "")
    ));
    assert_eq!(uf.reload().status, 200);
    let r = chat("", &[("x-request-id", theirs)], &uf);
    assert_eq!(r.header("x-request-id"), Some(theirs));
    let sent = fake.stats()["last_request_id"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(is_uuid(&sent) && sent != theirs, "{sent}");
}

#[test]
fn the_proxy_path_follows_the_pools_request_id_policy() {
    let origin = Origin::start("o");
    let uf = Ultrafast::start(&format!(
        "{}\n[[routes]]\npath = \"/\"\npool = \"p\"\n",
        pool_toml("p", &[&origin], "")
    ));
    let sent = |headers: &[(&str, &str)]| {
        let r = get(uf.addr, "/x", headers);
        assert_eq!(r.status, 200);
        let up = origin
            .state
            .last_headers
            .lock()
            .unwrap()
            .get("x-request-id")
            .cloned();
        (r.header("x-request-id").unwrap().to_string(), up)
    };
    let (ours, up) = sent(&[]);
    assert!(is_uuid(&ours));
    assert_eq!(up.as_deref(), Some(ours.as_str()));
    let (kept, up) = sent(&[("x-request-id", "abc")]);
    assert_eq!(kept, "abc");
    assert!(is_uuid(up.as_deref().unwrap()));
    uf.write_config(&format!(
        "{}\n[[routes]]\npath = \"/\"\npool = \"p\"\n",
        pool_toml("p", &[&origin], "request_id = \"none\"")
    ));
    assert_eq!(uf.reload().status, 200);
    let (_, up) = sent(&[("x-request-id", "abc")]);
    assert_eq!(up, None);
}

#[test]
fn an_upstream_error_says_what_the_server_said() {
    let fake = Fake::start(&["--tokens", "2"]);
    let uf = Ultrafast::start(&format!(
        "{INFERENCE_ROUTE}{}",
        upstream_model("m", &[&fake], "attempts = 1")
    ));
    let r = Client::connect(fake.addr)
        .unwrap()
        .request("POST", "/control", &[], br#"{"fail": true}"#)
        .unwrap();
    assert_eq!(r.status, 200);
    let r = chat("", &[], &uf);
    assert_eq!(r.status, 502, "{}", r.text());
    let e = &r.json()["error"];
    assert_eq!(e["code"], "upstream_unavailable");
    let msg = e["message"].as_str().unwrap();
    assert!(
        msg.contains("500") && msg.contains("fake overload"),
        "{msg}"
    );
}

#[test]
fn dialects_send_only_the_fields_each_server_takes() {
    let fake = Fake::start(&["--tokens", "2"]);
    let body = |dialect: &str| {
        uf_with(&fake, &format!("dialect = \"{dialect}\""), |uf| {
            assert_eq!(chat(r#","top_k":5,"seed":7"#, &[], uf).status, 200);
            fake.stats()["last_body"].clone()
        })
    };
    let openai = body("openai");
    assert!(openai.get("top_k").is_none(), "{openai}");
    assert_eq!(openai["seed"], 7);
    assert_eq!(openai["stream_options"]["include_usage"], true);
    let llama = body("llamacpp");
    assert_eq!(llama["top_k"], 5);
    assert!(llama.get("stream_options").is_none(), "{llama}");
    let vllm = body("vllm");
    assert_eq!(vllm["top_k"], 5);
    assert_eq!(vllm["stream_options"]["include_usage"], true);
}

/// Run `f` against ultrafast over `fake` with `pool_extra`.
fn uf_with<T>(fake: &Fake, pool_extra: &str, f: impl FnOnce(&Ultrafast) -> T) -> T {
    let uf = Ultrafast::start(&format!(
        "{INFERENCE_ROUTE}{}",
        upstream_model_in("m", &[fake], pool_extra, "")
    ));
    f(&uf)
}

#[test]
fn a_dialect_picks_the_health_path() {
    let fake = Fake::start(&[]);
    let check = "health_check = { interval_ms = 50 }";
    uf_with(&fake, &format!("dialect = \"vllm\"\n{check}"), |_| {
        assert!(eventually(Duration::from_secs(5), || fake
            .stat("health_gets")
            >= 2));
    });
    let models = fake.stat("models_gets");
    uf_with(&fake, &format!("dialect = \"openai\"\n{check}"), |_| {
        assert!(eventually(Duration::from_secs(5), || fake
            .stat("models_gets")
            >= models + 2));
    });
}

#[test]
fn pool_dialect_and_request_id_settings_are_validated() {
    let fake = Fake::start(&[]);
    let uf = Ultrafast::start(&format!(
        "{INFERENCE_ROUTE}{}",
        upstream_model("m", &[&fake], "")
    ));
    for (pool_extra, extra, field) in [
        ("dialect = \"triton\"", "", "pools.m-pool.dialect"),
        ("request_id = \"maybe\"", "", "pools.m-pool.request_id"),
        ("", "priority_field = \"vllm\"", "models.m.priority_field"),
    ] {
        uf.write_config(&format!(
            "{INFERENCE_ROUTE}{}",
            upstream_model_in("m", &[&fake], pool_extra, extra)
        ));
        let r = uf.reload();
        assert_eq!(r.status, 400, "{pool_extra} {extra}: {}", r.text());
        assert!(r.text().contains(field), "{}", r.text());
    }
}

#[test]
fn a_known_context_length_refuses_what_cannot_fit_in_openais_shape() {
    let fake = Fake::start(&["--tokens", "2"]);
    let uf = Ultrafast::start(&format!(
        "{INFERENCE_ROUTE}{}",
        upstream_model("m", &[&fake], "max_model_len = 2048")
    ));
    let post = |body: String| {
        Client::connect(uf.addr)
            .unwrap()
            .request("POST", "/v1/completions", &[], body.as_bytes())
            .unwrap()
    };
    let long = "word ".repeat(9000);
    let r = post(format!(
        r#"{{"model":"m","prompt":"{long}","max_tokens":4}}"#
    ));
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "context_length_exceeded");
    assert_eq!(r.json()["error"]["param"], "prompt");
    let r = post(r#"{"model":"m","prompt":"hi","max_tokens":100000}"#.into());
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["param"], "max_tokens");
    assert_eq!(
        post(r#"{"model":"m","prompt":"hi","max_tokens":4}"#.into()).status,
        200
    );
    assert_eq!(fake.stat("requests"), 1, "refusals never reach the server");
}
