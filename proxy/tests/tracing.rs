//! OpenTelemetry traces: a local OTLP/HTTP receiver (protobuf, decoded
//! with the OTLP protocol's own message types) gets one request span per
//! inference request, a child of the client's `traceparent`, with the
//! admission, queue, backend (prefill, decode) and response children and
//! the GenAI attributes; the upstream is sent a `traceparent` naming the
//! backend span. Without `[tracing]` the client's `traceparent` is passed
//! on unchanged.
#![allow(clippy::unwrap_used)]

mod common;
use common::infer::*;
use common::*;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use std::time::Duration;

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT: &str = "00f067aa0ba902b7";

/// Spans received, and the paths they were posted to.
#[derive(Default)]
struct Received {
    spans: Vec<Span>,
    paths: Vec<String>,
}

/// An OTLP/HTTP receiver on a loopback port, in a thread that ends with
/// the test process (it only accepts on its own listener).
fn receiver() -> (std::net::SocketAddr, Arc<Mutex<Received>>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let got = Arc::new(Mutex::new(Received::default()));
    let g = got.clone();
    std::thread::spawn(move || {
        for s in l.incoming().flatten() {
            let mut r = BufReader::new(s.try_clone().unwrap());
            let mut line = String::new();
            if r.read_line(&mut line).is_err() {
                continue;
            }
            let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
            let mut len = 0;
            loop {
                let mut h = String::new();
                if r.read_line(&mut h).unwrap_or(0) == 0 || h.trim().is_empty() {
                    break;
                }
                if let Some((k, v)) = h.split_once(':') {
                    if k.eq_ignore_ascii_case("content-length") {
                        len = v.trim().parse().unwrap_or(0);
                    }
                }
            }
            let mut body = vec![0; len];
            if r.read_exact(&mut body).is_err() {
                continue;
            }
            let req = ExportTraceServiceRequest::decode(body.as_slice()).unwrap();
            {
                let mut g = g.lock().unwrap();
                g.paths.push(path);
                for rs in req.resource_spans {
                    for ss in rs.scope_spans {
                        g.spans.extend(ss.spans);
                    }
                }
            }
            let mut s = s;
            let _ = s.write_all(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
            );
        }
    });
    (addr, got)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn attr(s: &Span, k: &str) -> Option<Any> {
    s.attributes
        .iter()
        .find(|a| a.key == k)
        .and_then(|a| a.value.clone())
        .and_then(|v| v.value)
}

fn chat(uf: &Ultrafast, stream: bool, traceparent: &str) -> Resp {
    let body = format!(
        r#"{{"model":"fm","messages":[{{"role":"user","content":"hello"}}],"max_tokens":5,"stream":{stream}}}"#
    );
    let mut c = Client::connect(uf.addr).unwrap();
    c.request(
        "POST",
        "/v1/chat/completions",
        &[
            ("content-type", "application/json"),
            ("traceparent", traceparent),
        ],
        body.as_bytes(),
    )
    .unwrap()
}

#[test]
fn inference_requests_are_traced_under_the_callers_trace() {
    let (otlp, got) = receiver();
    let fake = Fake::start(&["--name", "fm", "--tokens", "5", "--ttft-ms", "30"]);
    let uf = Ultrafast::start(&format!(
        "[tracing]\notlp_endpoint = \"http://{otlp}\"\nservice_name = \"edge-test\"\n\n{INFERENCE_ROUTE}{}",
        upstream_model("fm", &[&fake], "")
    ));
    let tp = format!("00-{TRACE}-{PARENT}-01");
    for stream in [false, true] {
        let r = chat(&uf, stream, &tp);
        assert_eq!(r.status, 200, "{}", r.text());
    }
    // A caller that says not to sample is recorded all the same (a client
    // cannot keep its requests out of the edge's traces), in its trace.
    let unsampled_trace = "1".repeat(32);
    let unsampled = format!("00-{unsampled_trace}-{PARENT}-00");
    assert_eq!(chat(&uf, false, &unsampled).status, 200);
    let complete = || {
        let g = got.lock().unwrap();
        g.spans.iter().filter(|s| s.name == "chat fm").count() >= 3
            && g.spans.iter().filter(|s| s.name == "decode").count() >= 3
    };
    assert!(
        eventually(Duration::from_secs(15), complete),
        "spans: {:?}\n{}",
        got.lock()
            .unwrap()
            .spans
            .iter()
            .map(|s| s.name.clone())
            .collect::<Vec<_>>(),
        uf.stderr()
    );
    let g = got.lock().unwrap();
    assert!(g.paths.iter().all(|p| p == "/v1/traces"), "{:?}", g.paths);
    assert!(
        g.spans
            .iter()
            .all(|s| hex(&s.trace_id) == TRACE || hex(&s.trace_id) == unsampled_trace),
        "a span outside the callers' traces"
    );
    let roots: Vec<&Span> = g.spans.iter().filter(|s| s.name == "chat fm").collect();
    assert_eq!(roots.len(), 3);
    for root in &roots {
        assert_eq!(
            hex(&root.parent_span_id),
            PARENT,
            "the caller's span is the parent"
        );
        assert_eq!(root.kind, 2, "a server span");
        let s = |k: &str| match attr(root, k) {
            Some(Any::StringValue(v)) => v,
            other => panic!("{k}: {other:?}"),
        };
        let i = |k: &str| match attr(root, k) {
            Some(Any::IntValue(v)) => v,
            other => panic!("{k}: {other:?}"),
        };
        assert_eq!(s("gen_ai.request.model"), "fm");
        assert_eq!(s("gen_ai.operation.name"), "chat");
        assert!(i("gen_ai.usage.input_tokens") > 0);
        assert_eq!(i("gen_ai.usage.output_tokens"), 5);
        match attr(root, "gen_ai.server.time_to_first_token") {
            Some(Any::DoubleValue(t)) => assert!((0.025..5.0).contains(&t), "ttft {t}"),
            other => panic!("ttft: {other:?}"),
        }
        let children = |parent: &[u8]| -> Vec<&Span> {
            g.spans
                .iter()
                .filter(|c| c.parent_span_id == parent)
                .collect()
        };
        let kids = children(&root.span_id);
        let names: Vec<&str> = kids.iter().map(|c| c.name.as_str()).collect();
        for want in ["admission", "queue", "backend", "response"] {
            assert!(
                names.contains(&want),
                "{want} missing under the request: {names:?}"
            );
        }
        for c in &kids {
            assert!(
                c.start_time_unix_nano >= root.start_time_unix_nano
                    && c.end_time_unix_nano <= root.end_time_unix_nano,
                "{} lies outside its parent",
                c.name
            );
        }
        let backend = kids.iter().find(|c| c.name == "backend").unwrap();
        let phases: Vec<&str> = children(&backend.span_id)
            .iter()
            .map(|c| c.name.as_str())
            .collect();
        assert!(
            phases.contains(&"prefill") && phases.contains(&"decode"),
            "{phases:?}"
        );
    }
    // The upstream was told the backend span of the last traced request.
    let sent = fake.stats()["last_traceparent"]
        .as_str()
        .unwrap()
        .to_string();
    let backends: Vec<String> = g
        .spans
        .iter()
        .filter(|s| s.name == "backend")
        .map(|s| format!("00-{}-{}-01", hex(&s.trace_id), hex(&s.span_id)))
        .collect();
    // The last request's upstream was sent its backend span, sampled.
    assert_eq!(backends.len(), 3, "{backends:?}");
    assert!(
        sent.starts_with(&format!("00-{unsampled_trace}-")) && backends.contains(&sent),
        "{sent} not among {backends:?}"
    );
}

#[test]
fn the_upstream_is_sent_the_backend_span() {
    let (otlp, got) = receiver();
    let fake = Fake::start(&["--name", "fm", "--tokens", "3"]);
    let uf = Ultrafast::start(&format!(
        "[tracing]\notlp_endpoint = \"http://{otlp}/v1/traces\"\n\n{INFERENCE_ROUTE}{}",
        upstream_model("fm", &[&fake], "")
    ));
    assert_eq!(chat(&uf, false, "not-a-traceparent").status, 200);
    let sent = fake.stats()["last_traceparent"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        eventually(Duration::from_secs(15), || got
            .lock()
            .unwrap()
            .spans
            .iter()
            .any(|s| s.name == "backend")),
        "no backend span"
    );
    let g = got.lock().unwrap();
    let backend = g.spans.iter().find(|s| s.name == "backend").unwrap();
    let root = g.spans.iter().find(|s| s.name == "chat fm").unwrap();
    // A malformed traceparent starts a new trace rather than joining one.
    assert!(root.parent_span_id.is_empty(), "{:?}", root.parent_span_id);
    assert_eq!(
        sent,
        format!("00-{}-{}-01", hex(&backend.trace_id), hex(&backend.span_id))
    );
}

#[test]
fn without_tracing_the_callers_traceparent_passes_through() {
    let fake = Fake::start(&["--name", "fm", "--tokens", "3"]);
    let uf = Ultrafast::start(&format!(
        "{INFERENCE_ROUTE}{}",
        upstream_model("fm", &[&fake], "")
    ));
    let tp = format!("00-{TRACE}-{PARENT}-01");
    assert_eq!(chat(&uf, false, &tp).status, 200);
    assert_eq!(fake.stats()["last_traceparent"], tp.as_str());
}

#[test]
fn a_bad_otlp_endpoint_is_a_config_error() {
    let dir = scratch("otlp-bad");
    let cfg = dir.join("bad.toml");
    std::fs::write(
        &cfg,
        "[tracing]\notlp_endpoint = \"https://collector:4318\"\n\n[[listeners]]\nname = \"h\"\naddress = \"127.0.0.1:0\"\n",
    )
    .unwrap();
    let out = std::process::Command::new(bin())
        .args(["check", "-c"])
        .arg(&cfg)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("tracing.otlp_endpoint") && err.contains("bad.toml:2"),
        "{err}"
    );
}

#[test]
fn proxied_requests_get_a_span_that_the_origin_is_told_of() {
    let (otlp, got) = receiver();
    let origin = Origin::start("o");
    let uf = Ultrafast::start(&format!(
        "[tracing]\notlp_endpoint = \"http://{otlp}\"\n\n[[routes]]\nname = \"web\"\npath = \"/\"\npool = \"web\"\n\n{}",
        pool_toml("web", &[&origin], "")
    ));
    let tp = format!("00-{TRACE}-{PARENT}-01");
    let r = get(uf.addr, "/page", &[("traceparent", tp.as_str())]);
    assert_eq!(r.status, 200);
    let sent = origin.state.last_headers.lock().unwrap()["traceparent"].clone();
    assert!(
        eventually(Duration::from_secs(15), || got
            .lock()
            .unwrap()
            .spans
            .iter()
            .any(|s| s.name == "GET web")),
        "no span for the proxied request"
    );
    let g = got.lock().unwrap();
    let span = g.spans.iter().find(|s| s.name == "GET web").unwrap();
    assert_eq!(hex(&span.trace_id), TRACE);
    assert_eq!(hex(&span.parent_span_id), PARENT);
    assert_eq!(
        attr(span, "http.response.status_code"),
        Some(Any::IntValue(200))
    );
    // The origin is told this span, not the caller's.
    assert_eq!(sent, format!("00-{TRACE}-{}-01", hex(&span.span_id)));
}
