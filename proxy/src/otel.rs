//! Traces: one span per inference request with children for admission,
//! queue, backend (prefill, decode) and the response, carrying the GenAI
//! semantic-convention attributes, exported over OTLP/HTTP (protobuf) when
//! `[tracing] otlp_endpoint` is set. A client's W3C `traceparent` makes the
//! request span its child, and upstream pools are sent a `traceparent`
//! naming the backend span.
//!
//! Off by default, and then free: `begin` is one load of an empty
//! `OnceLock` and nothing else is built. On, the spans whose ids must be
//! known early (the request's, the backend's) are started when their work
//! starts; the others are written when the request ends, from the times it
//! recorded, so the request path takes no lock and makes no call for them.
//! Spans go to the SDK's batch processor (its own thread, a bounded queue
//! that drops when full), never blocking a request.

use opentelemetry::trace::{
    Span, SpanContext, SpanKind, Status, TraceContextExt, TraceFlags, TraceId, TraceState, Tracer,
    TracerProvider,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider};
use std::sync::OnceLock;
use std::time::{Duration, Instant, SystemTime};

mod client;

struct Otel {
    tracer: SdkTracer,
    provider: SdkTracerProvider,
}

static OTEL: OnceLock<Otel> = OnceLock::new();

/// The collector URL for traces: `endpoint` as given when it names a path,
/// else with OTLP/HTTP's `/v1/traces`.
pub fn traces_url(endpoint: &str) -> String {
    let e = endpoint.trim_end_matches('/');
    let path_given = e
        .strip_prefix("http://")
        .and_then(|rest| rest.split_once('/'))
        .is_some_and(|(_, p)| !p.is_empty());
    if path_given {
        e.to_string()
    } else {
        format!("{e}/v1/traces")
    }
}

/// Start exporting to `endpoint` (an `http://` URL) as `service`. Once per
/// process; a second call changes nothing.
pub fn init(endpoint: &str, service: &str) -> Result<(), String> {
    use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
    let url = traces_url(endpoint);
    let client = client::Client::new(&url)?;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(client)
        .with_endpoint(url.clone())
        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
        .with_timeout(Duration::from_secs(5))
        .build()
        .map_err(|e| format!("OTLP exporter: {e}"))?;
    let resource = opentelemetry_sdk::Resource::builder_empty()
        .with_attributes([
            KeyValue::new("service.name", service.to_string()),
            KeyValue::new("service.version", env!("CARGO_PKG_VERSION")),
        ])
        .build();
    // A second between batches (the SDK's default is five): traces show
    // up while the request is still on the operator's mind.
    let batch = opentelemetry_sdk::trace::BatchConfigBuilder::default()
        .with_scheduled_delay(Duration::from_secs(1))
        .build();
    let processor = opentelemetry_sdk::trace::BatchSpanProcessor::builder(exporter)
        .with_batch_config(batch)
        .build();
    let provider = SdkTracerProvider::builder()
        .with_span_processor(processor)
        .with_resource(resource)
        .build();
    let tracer = provider.tracer("ultrafast");
    if OTEL.set(Otel { tracer, provider }).is_ok() {
        log::info!("tracing: exporting spans to {url}");
    }
    Ok(())
}

/// Whether spans are exported (a caller can skip building a span's name).
pub fn enabled() -> bool {
    OTEL.get().is_some()
}

/// Send what is queued (at shutdown).
pub fn flush() {
    if let Some(o) = OTEL.get() {
        let _ = o.provider.force_flush();
    }
}

/// A W3C `traceparent` value's trace id, parent span id and flags.
pub fn parse_traceparent(v: &str) -> Option<(TraceId, opentelemetry::trace::SpanId, TraceFlags)> {
    let mut parts = v.trim().split('-');
    let (version, trace, span, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    // Version 00 has exactly four fields; a later version may add more.
    let hex = |s: &str, n: usize| {
        s.len() == n
            && s.bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
    };
    if !hex(version, 2) || version == "ff" || (version == "00" && parts.next().is_some()) {
        return None;
    }
    if !hex(trace, 32) || !hex(span, 16) || !hex(flags, 2) {
        return None;
    }
    let trace = TraceId::from_hex(trace).ok()?;
    let span = opentelemetry::trace::SpanId::from_hex(span).ok()?;
    let flags = u8::from_str_radix(flags, 16).ok()?;
    (trace != TraceId::INVALID && span != opentelemetry::trace::SpanId::INVALID).then_some((
        trace,
        span,
        TraceFlags::new(flags),
    ))
}

/// The `traceparent` that names `cx`'s span as the parent.
fn traceparent(cx: &Context) -> String {
    let span = cx.span();
    let sc = span.span_context();
    format!(
        "00-{}-{}-{:02x}",
        sc.trace_id(),
        sc.span_id(),
        sc.trace_flags().to_u8()
    )
}

/// One request's trace: its span, started at its arrival. Clones share
/// the span.
#[derive(Clone)]
pub struct ReqTrace {
    root: Context,
    /// The wall-clock time of `arrived`, to place spans written later.
    epoch: SystemTime,
    arrived: Instant,
}

impl std::fmt::Debug for ReqTrace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ReqTrace")
    }
}

/// Times a finished inference request recorded, for its child spans.
#[derive(Debug, Clone, Copy)]
pub struct Phases {
    /// The lane gate was reached (admission ends).
    pub gate: Instant,
    /// A slot was granted (the queue ends).
    pub admitted: Instant,
    /// The backend was asked.
    pub dispatched: Instant,
    /// The first token arrived from it.
    pub first_token: Option<Instant>,
    /// The backend finished.
    pub backend_done: Instant,
    /// The response was written whole.
    pub end: Instant,
}

/// A started backend span: its context, for the children and the header.
pub struct BackendSpan {
    cx: Context,
}

impl BackendSpan {
    /// What an upstream is sent as `traceparent`.
    pub fn traceparent(&self) -> String {
        traceparent(&self.cx)
    }
}

impl ReqTrace {
    /// A trace for a request that arrived at `arrived` with `headers`, named
    /// `name`; None when tracing is off.
    pub fn begin(headers: &http::HeaderMap, arrived: Instant, name: &str) -> Option<ReqTrace> {
        let otel = OTEL.get()?;
        let parent = headers
            .get("traceparent")
            .and_then(|v| v.to_str().ok())
            .and_then(parse_traceparent);
        // The edge records every request whatever the caller's sampled
        // flag says: a client must not be able to keep its requests out of
        // the operator's traces. Its trace id and span are kept as the
        // parent, so a traced client still sees one trace.
        let cx = match parent {
            Some((trace, span, _)) => Context::new().with_remote_span_context(SpanContext::new(
                trace,
                span,
                TraceFlags::SAMPLED,
                true,
                TraceState::default(),
            )),
            None => Context::new(),
        };
        let epoch = SystemTime::now() - arrived.elapsed();
        let span = otel
            .tracer
            .span_builder(name.to_string())
            .with_kind(SpanKind::Server)
            .with_start_time(epoch)
            .start_with_context(&otel.tracer, &cx);
        Some(ReqTrace {
            root: cx.with_span(span),
            epoch,
            arrived,
        })
    }

    fn at(&self, t: Instant) -> SystemTime {
        self.epoch + t.saturating_duration_since(self.arrived)
    }

    /// Start the backend span now (its id goes upstream).
    pub fn backend(&self, attrs: Vec<KeyValue>) -> Option<BackendSpan> {
        let otel = OTEL.get()?;
        let span = otel
            .tracer
            .span_builder("backend")
            .with_kind(SpanKind::Client)
            .with_attributes(attrs)
            .start_with_context(&otel.tracer, &self.root);
        Some(BackendSpan {
            cx: self.root.with_span(span),
        })
    }

    fn child(&self, parent: &Context, name: &'static str, from: Instant, to: Instant) {
        let Some(otel) = OTEL.get() else { return };
        let mut span = otel
            .tracer
            .span_builder(name)
            .with_kind(SpanKind::Internal)
            .with_start_time(self.at(from))
            .start_with_context(&otel.tracer, parent);
        span.end_with_timestamp(self.at(to.max(from)));
    }

    /// Write the children from `p`, set the request span's attributes and
    /// end it (and the backend span) at `p.end`.
    pub fn finish(
        &self,
        backend: Option<&BackendSpan>,
        p: &Phases,
        name: &str,
        attrs: Vec<KeyValue>,
    ) {
        self.child(&self.root, "admission", self.arrived, p.gate);
        self.child(&self.root, "queue", p.gate, p.admitted);
        if let Some(b) = backend {
            if let Some(first) = p.first_token {
                self.child(&b.cx, "prefill", p.dispatched, first);
                self.child(&b.cx, "decode", first, p.backend_done);
            }
            b.cx.span().end_with_timestamp(self.at(p.backend_done));
        }
        self.child(&self.root, "response", p.backend_done, p.end);
        let root = self.root.span();
        root.update_name(name.to_string());
        root.set_attributes(attrs);
        root.end_with_timestamp(self.at(p.end));
    }

    /// What an upstream of a proxied request is sent as `traceparent`.
    pub fn traceparent(&self) -> String {
        traceparent(&self.root)
    }

    /// End a proxied request's span with its status and attributes.
    pub fn end_http(&self, status: u16, mut attrs: Vec<KeyValue>) {
        let root = self.root.span();
        attrs.push(KeyValue::new("http.response.status_code", status as i64));
        root.set_attributes(attrs);
        if status >= 500 || status == 0 {
            root.set_status(Status::error(format!("status {status}")));
        }
        root.end();
    }

    /// End the request span as failed (refused, errored, abandoned).
    pub fn fail(&self, why: &str) {
        let root = self.root.span();
        root.set_status(Status::error(why.to_string()));
        root.end();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparent_is_parsed_strictly() {
        let ok = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        let (t, s, f) = parse_traceparent(ok).unwrap();
        assert_eq!(t.to_string(), "0af7651916cd43dd8448eb211c80319c");
        assert_eq!(s.to_string(), "b7ad6b7169203331");
        assert!(f.is_sampled());
        for bad in [
            "",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
            "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
            "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",
            "00-0af7651916cd43dd8448eb211c8031-b7ad6b7169203331-01",
        ] {
            assert!(parse_traceparent(bad).is_none(), "{bad}");
        }
        // A later version may carry more fields.
        assert!(
            parse_traceparent("01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-more")
                .is_some()
        );
    }

    #[test]
    fn the_traces_path_is_added_when_missing() {
        assert_eq!(
            traces_url("http://127.0.0.1:4318"),
            "http://127.0.0.1:4318/v1/traces"
        );
        assert_eq!(
            traces_url("http://127.0.0.1:4318/"),
            "http://127.0.0.1:4318/v1/traces"
        );
        assert_eq!(
            traces_url("http://c:4318/custom/traces"),
            "http://c:4318/custom/traces"
        );
    }

    #[test]
    fn off_means_no_trace() {
        // Nothing in unit tests initializes the exporter.
        assert!(ReqTrace::begin(&http::HeaderMap::new(), Instant::now(), "x").is_none());
    }
}
