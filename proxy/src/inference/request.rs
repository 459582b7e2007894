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
