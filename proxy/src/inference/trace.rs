//! The GenAI semantic-convention attributes of an inference request's
//! spans (OpenTelemetry's `gen_ai.*` registry), from what the pipeline
//! already knows; built only when tracing is on.

use super::context::Call;
use super::delivery::{Finished, Timing};
use opentelemetry::KeyValue;
use ultrafast_engine::api::Prompt;

fn operation(call: &Call) -> &'static str {
    match call.req.prompt {
        Prompt::Chat(_) => "chat",
        Prompt::Text(_) | Prompt::Tokens(_) => "text_completion",
    }
}

/// The backend span's attributes.
pub(super) fn backend_attrs(call: &Call) -> Vec<KeyValue> {
    vec![
        KeyValue::new("gen_ai.operation.name", operation(call)),
        KeyValue::new("gen_ai.request.model", call.model.name.clone()),
        KeyValue::new("ultrafast.backend", call.backend.kind()),
    ]
}

/// The request span's name (`{operation} {model}`, as the conventions
/// ask) and attributes, less what is known at its end (`end_attrs`).
pub(super) fn request_attrs(call: &Call, lane: &str) -> (String, Vec<KeyValue>) {
    let op = operation(call);
    let attrs = vec![
        KeyValue::new("gen_ai.operation.name", op),
        KeyValue::new("gen_ai.request.model", call.model.name.clone()),
        KeyValue::new("gen_ai.response.model", call.model.name.clone()),
        KeyValue::new("gen_ai.request.max_tokens", call.prepared.max_tokens as i64),
        KeyValue::new("ultrafast.lane", lane.to_string()),
        KeyValue::new("ultrafast.request_id", call.req.request_id.clone()),
    ];
    (format!("{op} {}", call.model.name), attrs)
}

/// The usage, finish reason and times (seconds) of a finished request.
pub(super) fn end_attrs(end: &Finished, t: &Timing) -> [KeyValue; 6] {
    let s = |d: std::time::Duration| d.as_secs_f64();
    let finish = opentelemetry::Array::String(vec![end.finish.as_str().into()]);
    [
        KeyValue::new("gen_ai.usage.input_tokens", end.usage.prompt_tokens as i64),
        KeyValue::new(
            "gen_ai.usage.output_tokens",
            end.usage.completion_tokens as i64,
        ),
        KeyValue::new(
            "gen_ai.response.finish_reasons",
            opentelemetry::Value::Array(finish),
        ),
        KeyValue::new(
            "gen_ai.server.time_to_first_token",
            s(t.ttft.unwrap_or_default()),
        ),
        KeyValue::new("gen_ai.server.request.duration", s(t.total)),
        KeyValue::new("ultrafast.queue_seconds", s(t.queue)),
    ]
}
