//! The request-side types every dialect shares: which API a request came
//! in (`Dialect`) and the Responses API's own settings. A leaf: the parsed
//! request (`openai::Parsed`) names these, not the dialects' writers.

use serde_json::{Map, Value};

/// The API a request came in.
#[derive(Debug, Clone, PartialEq)]
pub enum Dialect {
    /// OpenAI chat completions or completions.
    OpenAi,
    /// Anthropic Messages.
    Anthropic,
    /// OpenAI Responses.
    Responses(ResponsesOpts),
}

/// The Responses request's own settings.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ResponsesOpts {
    /// Keep the response for `GET` and `previous_response_id`.
    pub store: bool,
    /// The response this one continues.
    pub previous: Option<String>,
    /// The request as the response object echoes it.
    pub echo: Map<String, Value>,
}

/// Which sampling fields a request set itself: the others take the
/// model's `sampling` defaults (`[models.X] sampling`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Given {
    /// `temperature`.
    pub temperature: bool,
    /// `top_p`.
    pub top_p: bool,
    /// `top_k`.
    pub top_k: bool,
    /// `min_p`.
    pub min_p: bool,
    /// `repetition_penalty`.
    pub repetition_penalty: bool,
    /// `frequency_penalty`.
    pub frequency_penalty: bool,
    /// `presence_penalty`.
    pub presence_penalty: bool,
}

impl Given {
    /// The fields of `SAMPLING_FIELDS` present in a request body.
    pub fn of(o: &Map<String, Value>) -> Given {
        let has = |k: &str| o.get(k).is_some_and(|v| !v.is_null());
        Given {
            temperature: has("temperature"),
            top_p: has("top_p"),
            top_k: has("top_k"),
            min_p: has("min_p"),
            repetition_penalty: has("repetition_penalty"),
            frequency_penalty: has("frequency_penalty"),
            presence_penalty: has("presence_penalty"),
        }
    }

    /// `s` with the model's defaults `d` in the fields the request did not
    /// set.
    pub fn apply(
        self,
        s: &mut ultrafast_engine::api::SamplingParams,
        d: &crate::config::file::SamplingSection,
    ) {
        let f = |v: Option<f64>, given: bool| if given { None } else { v.map(|x| x as f32) };
        if let Some(t) = f(d.temperature, self.temperature) {
            s.temperature = t;
        }
        if let Some(p) = f(d.top_p, self.top_p) {
            s.top_p = p;
        }
        if let (Some(k), false) = (d.top_k, self.top_k) {
            s.top_k = k as usize;
        }
        if let Some(p) = f(d.min_p, self.min_p) {
            s.min_p = p;
        }
        if let Some(r) = f(d.repetition_penalty, self.repetition_penalty) {
            s.repetition_penalty = r;
        }
        if let Some(p) = f(d.frequency_penalty, self.frequency_penalty) {
            s.frequency_penalty = p;
        }
        if let Some(p) = f(d.presence_penalty, self.presence_penalty) {
            s.presence_penalty = p;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::file::SamplingSection;
    use ultrafast_engine::api::SamplingParams;

    #[test]
    fn the_models_defaults_fill_only_what_the_request_left_out() {
        let d = SamplingSection {
            temperature: Some(0.2),
            top_p: Some(0.9),
            top_k: Some(40),
            min_p: Some(0.05),
            repetition_penalty: Some(1.1),
            frequency_penalty: Some(0.5),
            presence_penalty: Some(0.25),
        };
        let o: Map<String, Value> =
            serde_json::from_str(r#"{"temperature": 0.7, "top_k": 0, "min_p": null}"#).unwrap();
        let given = Given::of(&o);
        // What the parser made of the request: its fields, else the API's.
        let mut s = SamplingParams {
            temperature: 0.7,
            ..SamplingParams::default()
        };
        given.apply(&mut s, &d);
        assert_eq!(s.temperature, 0.7, "set by the request");
        assert_eq!(s.top_k, 0, "set by the request (0 = off)");
        assert_eq!(s.top_p, 0.9);
        assert_eq!(s.min_p, 0.05, "null counts as omitted");
        assert_eq!(s.repetition_penalty, 1.1);
        assert_eq!((s.frequency_penalty, s.presence_penalty), (0.5, 0.25));
        // No defaults: the request's values stand.
        let mut t = SamplingParams::default();
        Given::default().apply(&mut t, &SamplingSection::default());
        assert_eq!(t, SamplingParams::default());
    }
}
