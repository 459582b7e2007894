//! Structured decoding on the real model: JSON that fits its schema, tool
//! calls of the chosen function with valid arguments, a schema the library
//! cannot compile refused with its reason, and constrained and
//! unconstrained sequences batched together each getting what they would
//! alone.

#![allow(clippy::unwrap_used)]
use serde_json::{json, Value};
use std::sync::OnceLock;
use ultrafast_engine::api::{Structure, Tool, ToolChoice};
use ultrafast_engine::guide::{CALL_CLOSE, CALL_OPEN};
use ultrafast_engine::sampling::SamplingParams;
use ultrafast_engine::scheduler::GenerateRequest;
use ultrafast_engine::scheduler::{Engine, EngineConfig};

mod common;
use common::{loaded, text};

fn engine() -> &'static Engine {
    static E: OnceLock<Engine> = OnceLock::new();
    E.get_or_init(|| Engine::start(loaded(), EngineConfig::default()).unwrap())
}

fn req(q: &str, s: Option<&Structure>, max_tokens: usize) -> GenerateRequest {
    let l = loaded();
    let greedy = SamplingParams {
        temperature: 0.0,
        ..Default::default()
    };
    GenerateRequest {
        guide: s.map(|s| l.guides.as_ref().unwrap().compile(s).unwrap()),
        ..common::request(common::prompt(q), greedy, max_tokens)
    }
}

fn run(q: &str, s: Option<&Structure>) -> String {
    text(engine().submit(req(q, s, 120)).unwrap())
}

#[test]
fn json_follows_the_schema() {
    let schema = json!({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": ["red", "green", "blue"]}},
        "required": ["name", "age", "color"], "additionalProperties": false});
    let out = run("Describe a person as JSON.", Some(&Structure::Json(schema)));
    let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert!(v["name"].as_str().unwrap().chars().count() <= 20, "{out}");
    assert!((0..=150).contains(&v["age"].as_i64().unwrap()), "{out}");
    assert!(
        ["red", "green", "blue"].contains(&v["color"].as_str().unwrap()),
        "{out}"
    );
}

#[test]
fn a_named_tool_is_called_with_valid_arguments() {
    let tools = vec![
        Tool {
            name: "get_weather".into(),
            description: Some("Weather of a city".into()),
            // Closed, so that the call ends after its two arguments (an
            // open object let greedy SmolLM2 add a long `description`).
            parameters: json!({"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"], "additionalProperties": false}),
        },
        Tool {
            name: "other".into(),
            description: None,
            parameters: json!({"type": "object", "properties": {}}),
        },
    ];
    let s = Structure::Tools {
        tools,
        choice: ToolChoice::Named("get_weather".into()),
        parallel: true,
    };
    let out = run("What is the weather in Paris?", Some(&s));
    let body = out
        .strip_prefix(CALL_OPEN)
        .and_then(|b| b.strip_suffix(CALL_CLOSE))
        .unwrap_or_else(|| panic!("not one call: {out}"));
    let v: Value = serde_json::from_str(body).unwrap();
    assert_eq!(v["name"], "get_weather");
    assert!(v["arguments"]["city"].is_string(), "{out}");
    assert!(["celsius", "fahrenheit"].contains(&v["arguments"]["unit"].as_str().unwrap()));
}

#[test]
fn a_schema_that_cannot_compile_is_refused_with_the_reason() {
    let l = loaded();
    let g = l.guides.as_ref().unwrap();
    let e = g
        .compile(&Structure::Json(json!({"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["a"]})))
        .unwrap_err();
    assert!(!e.is_empty());
    let e = g
        .compile(&Structure::Json(json!("not a schema")))
        .unwrap_err();
    assert!(e.contains("object"), "{e}");
}

#[test]
fn constrained_and_free_sequences_batched_get_what_they_get_alone() {
    let schema = Structure::Json(
        json!({"type": "object", "properties": {"answer": {"type": "string", "maxLength": 40}}, "required": ["answer"]}),
    );
    let qs = [
        "What is 2+2?",
        "Name a fruit.",
        "Say hi.",
        "What color is the sky?",
    ];
    let alone: Vec<String> = qs
        .iter()
        .enumerate()
        .map(|(i, q)| run(q, (i % 2 == 0).then_some(&schema)))
        .collect();
    let rxs: Vec<_> = qs
        .iter()
        .enumerate()
        .map(|(i, q)| {
            engine()
                .submit(req(q, (i % 2 == 0).then_some(&schema), 120))
                .unwrap()
        })
        .collect();
    let batched: Vec<String> = rxs.into_iter().map(text).collect();
    for (i, (a, b)) in alone.iter().zip(&batched).enumerate() {
        assert_eq!(a, b, "sequence {i}");
        if i % 2 == 0 {
            let v: Value = serde_json::from_str(b).unwrap_or_else(|e| panic!("{e}: {b}"));
            assert!(v["answer"].is_string());
        }
    }
}

#[test]
fn auto_tools_allow_text_or_calls_but_no_call_after_text() {
    let l = loaded();
    let g = l.guides.as_ref().unwrap();
    let s = Structure::Tools {
        tools: vec![Tool {
            name: "f".into(),
            description: None,
            parameters: json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
        }],
        choice: ToolChoice::Auto,
        parallel: true,
    };
    // Every token of `text` taken in turn: whether the grammar allows it all.
    let fits = |text: &str| {
        let mut guide = g.compile(&s).unwrap();
        l.codec
            .encode(text)
            .unwrap()
            .iter()
            .all(|t| guide.commit(*t).is_ok())
    };
    assert!(fits("Hello there, no call needed."));
    assert!(fits(
        r#"<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>"#
    ));
    assert!(!fits(
        r#"Sure. <tool_call>{"name": "nope", "arguments": 7}</tool_call>"#
    ));
    assert!(!fits(
        r#"<tool_call>{"name": "f", "arguments": {"a": "x"}}</tool_call>"#
    ));
}
