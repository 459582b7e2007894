//! The second known model end to end on the engine: Qwen2.5-Coder-0.5B
//! Q4_K_M (fetched from its six wheels) on the engine's own kernels, its
//! chat template given the tools (the template's own `<tools>` section),
//! a named tool call with valid arguments in its Hermes `<tool_call>`
//! format, and JSON that fits a schema. Token-level correctness is
//! `golden.rs`'s.

#![allow(clippy::unwrap_used)]
use serde_json::{json, Value};
use std::sync::Arc;
use ultrafast_engine::api::{Structure, Tool, ToolChoice};
use ultrafast_engine::backend::loaded::Loaded;
use ultrafast_engine::fetch::{self, QWEN25_CODER};
use ultrafast_engine::generate;
use ultrafast_engine::guide::{CALL_CLOSE, CALL_OPEN};
use ultrafast_engine::sampling::SamplingParams;
use ultrafast_engine::scheduler::{Engine, EngineConfig, GenerateRequest};
use ultrafast_engine::tokenizer::ChatMessage;

mod common;
use common::text;

fn request(l: &Loaded, rendered: &str, s: &Structure) -> GenerateRequest {
    let greedy = SamplingParams {
        temperature: 0.0,
        ..Default::default()
    };
    GenerateRequest {
        guide: Some(l.guides.as_ref().unwrap().compile(s).unwrap()),
        ..common::request(l.codec.encode(rendered).unwrap(), greedy, 80)
    }
}

#[test]
fn qwen_runs_on_the_kernels_and_calls_tools_and_fills_schemas() {
    let path = fetch::pull(&QWEN25_CODER).unwrap();
    let l: Arc<Loaded> = Arc::new(generate::load(&path).unwrap());
    // The engine's kernels take every tensor (no candle fallback).
    if let Err(e) = &l.fast {
        panic!("Qwen2.5 fell back to candle: {e}");
    }
    assert!(l.codec.template_takes_tools());
    let tools = vec![
        Tool {
            name: "get_weather".into(),
            description: Some("Weather of a city".into()),
            parameters: json!({"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"]}),
        },
        Tool {
            name: "other".into(),
            description: None,
            parameters: json!({"type": "object", "properties": {}}),
        },
    ];
    let user = [ChatMessage::new("user", "What is the weather in Paris?")];
    let rendered = l.codec.render_chat_tools(&user, Some(&tools)).unwrap();
    assert!(
        rendered.contains("<tools>") && rendered.contains("get_weather"),
        "{rendered}"
    );
    let e = Engine::start(l.clone(), EngineConfig::default()).unwrap();
    let s = Structure::Tools {
        tools,
        choice: ToolChoice::Named("get_weather".into()),
        parallel: false,
    };
    let out = text(e.submit(request(&l, &rendered, &s)).unwrap());
    let body = out
        .strip_prefix(CALL_OPEN)
        .and_then(|b| b.strip_suffix(CALL_CLOSE))
        .unwrap_or_else(|| panic!("not one call: {out}"));
    let v: Value = serde_json::from_str(body).unwrap();
    assert_eq!(v["name"], "get_weather", "{out}");
    let city = v["arguments"]["city"].as_str().unwrap();
    assert!(city.contains("Paris"), "{out}");
    assert!(["celsius", "fahrenheit"].contains(&v["arguments"]["unit"].as_str().unwrap()));

    let schema = json!({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150}},
        "required": ["name", "age"], "additionalProperties": false});
    let q = [ChatMessage::new("user", "Describe a person as JSON.")];
    let rendered = l.codec.render_chat(&q).unwrap();
    let out = text(
        e.submit(request(&l, &rendered, &Structure::Json(schema)))
            .unwrap(),
    );
    let v: Value = serde_json::from_str(&out).unwrap_or_else(|err| panic!("{err}: {out}"));
    assert!(v["name"].as_str().unwrap().chars().count() <= 20, "{out}");
    assert!((0..=150).contains(&v["age"].as_i64().unwrap()), "{out}");
}
