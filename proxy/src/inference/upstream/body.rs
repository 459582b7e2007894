//! The JSON body of an upstream request, serialized straight from the
//! request's fields. Built as a `serde_json::Value` map first, it cost a
//! tree of allocations and a second walk on every request (about 15,000
//! instructions, an eighth of the request side: benches/RESULTS.md
//! section 15); the keys and their order are unchanged.

use serde::ser::{Serialize, SerializeSeq, Serializer};
use serde_json::{Map, Value};
use ultrafast_engine::tokenizer::ChatMessage;

/// The body's fields, in the order they are written.
#[derive(serde::Serialize)]
pub(super) struct UpstreamBody<'a> {
    pub model: &'a str,
    /// Set (true) with `add_generation_prompt` (false) when a chat resumes:
    /// vLLM then continues the final (assistant) message.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub continue_final_message: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub add_generation_prompt: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub messages: Option<Messages<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt: Option<Concat<'a>>,
    pub max_tokens: usize,
    /// As `f64` (the value the map held): `0.7f32` goes out as
    /// `0.699999988079071`, as before.
    pub temperature: f64,
    pub top_p: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_k: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub frequency_penalty: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub presence_penalty: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub repetition_penalty: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_p: Option<f32>,
    /// Token ids to biases, as OpenAI writes them (`{"42": -100}`).
    #[serde(
        skip_serializing_if = "<[(u32, f32)]>::is_empty",
        serialize_with = "bias_map"
    )]
    pub logit_bias: &'a [(u32, f32)],
    /// Chat: `true`; completions: the number of alternatives.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<Value>,
    /// Chat's alternatives per token.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_logprobs: Option<usize>,
    #[serde(skip_serializing_if = "<[String]>::is_empty")]
    pub stop: &'a [String],
    #[serde(skip_serializing_if = "Option::is_none")]
    pub user: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub priority: Option<u32>,
    /// Structured outputs and tools, exactly as the client sent them (their
    /// names are none of the fields above: `openai::PASSTHROUGH`).
    #[serde(flatten)]
    pub passthrough: &'a Map<String, Value>,
    pub stream: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stream_options: Option<IncludeUsage>,
}

fn bias_map<S: Serializer>(bias: &&[(u32, f32)], s: S) -> Result<S::Ok, S::Error> {
    use serde::ser::SerializeMap;
    let mut m = s.serialize_map(Some(bias.len()))?;
    for (t, b) in bias.iter() {
        m.serialize_entry(&t.to_string(), b)?;
    }
    m.end()
}

/// A chat's messages, and with `resumed` the assistant's text so far as a
/// final message.
pub(super) struct Messages<'a> {
    pub messages: &'a [ChatMessage],
    pub resumed: Option<&'a str>,
}

impl Serialize for Messages<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let extra = usize::from(self.resumed.is_some());
        let mut seq = s.serialize_seq(Some(self.messages.len() + extra))?;
        for m in self.messages {
            seq.serialize_element(m)?;
        }
        if let Some(text) = self.resumed {
            seq.serialize_element(&ChatMessage::new("assistant", text))?;
        }
        seq.end()
    }
}

/// Two strings written as one (a prompt and what was already delivered of
/// its completion), without joining them first.
pub(super) struct Concat<'a>(pub &'a str, pub &'a str);

impl Serialize for Concat<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if self.1.is_empty() {
            return s.serialize_str(self.0);
        }
        s.collect_str(&format_args!("{}{}", self.0, self.1))
    }
}

/// `{"include_usage": true}`: the final chunk carries the usage.
#[derive(serde::Serialize)]
pub(super) struct IncludeUsage {
    pub include_usage: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn body<'a>(
        messages: Option<Messages<'a>>,
        prompt: Option<Concat<'a>>,
        passthrough: &'a Map<String, Value>,
        stop: &'a [String],
    ) -> UpstreamBody<'a> {
        UpstreamBody {
            model: "up",
            continue_final_message: None,
            add_generation_prompt: None,
            messages,
            prompt,
            max_tokens: 16,
            temperature: f64::from(0.7f32),
            top_p: 1.0,
            top_k: None,
            seed: None,
            frequency_penalty: None,
            presence_penalty: None,
            repetition_penalty: None,
            min_p: None,
            logit_bias: &[],
            logprobs: None,
            top_logprobs: None,
            stop,
            user: None,
            priority: None,
            passthrough,
            stream: true,
            stream_options: Some(IncludeUsage {
                include_usage: true,
            }),
        }
    }

    #[test]
    fn a_chat_body_has_the_map_builders_keys_in_its_order() {
        let msgs = [ChatMessage::new("user", "hi \"there\"")];
        let mut pass = Map::new();
        pass.insert("tool_choice".into(), json!("auto"));
        let stop = ["\n".to_string()];
        let b = body(
            Some(Messages {
                messages: &msgs,
                resumed: None,
            }),
            None,
            &pass,
            &stop,
        );
        let text = serde_json::to_string(&b).unwrap();
        assert_eq!(
            text,
            "{\"model\":\"up\",\"messages\":[{\"role\":\"user\",\"content\":\"hi \\\"there\\\"\"}],\
             \"max_tokens\":16,\"temperature\":0.699999988079071,\"top_p\":1.0,\"stop\":[\"\\n\"],\
             \"tool_choice\":\"auto\",\"stream\":true,\"stream_options\":{\"include_usage\":true}}"
        );
        // The same value the `Value` map gave.
        let mut o = Map::new();
        o.insert("model".into(), json!("up"));
        o.insert("messages".into(), json!(msgs));
        o.insert("max_tokens".into(), json!(16));
        o.insert("temperature".into(), json!(0.7f32));
        o.insert("top_p".into(), json!(1.0f32));
        o.insert("stop".into(), json!(stop));
        o.insert("tool_choice".into(), json!("auto"));
        o.insert("stream".into(), json!(true));
        o.insert("stream_options".into(), json!({"include_usage": true}));
        assert_eq!(Value::Object(o).to_string(), text);
    }

    #[test]
    fn penalties_and_bias_go_out_as_openai_writes_them() {
        let pass = Map::new();
        let mut b = body(None, Some(Concat("x", "")), &pass, &[]);
        b.frequency_penalty = Some(0.5);
        b.min_p = Some(0.25);
        let bias = [(42, -100.0), (7, 2.5)];
        b.logit_bias = &bias;
        let v: Value = serde_json::from_str(&serde_json::to_string(&b).unwrap()).unwrap();
        assert_eq!(v["frequency_penalty"], json!(0.5));
        assert_eq!(v["min_p"], json!(0.25));
        assert_eq!(v["logit_bias"], json!({"42": -100.0, "7": 2.5}));
        assert!(v.get("presence_penalty").is_none() && v.get("repetition_penalty").is_none());
    }

    #[test]
    fn a_resumed_body_continues_the_final_message_and_the_prompt() {
        let msgs = [ChatMessage::new("user", "count")];
        let pass = Map::new();
        let mut b = body(
            Some(Messages {
                messages: &msgs,
                resumed: Some("one two"),
            }),
            None,
            &pass,
            &[],
        );
        b.continue_final_message = Some(true);
        b.add_generation_prompt = Some(false);
        let v: Value = serde_json::from_str(&serde_json::to_string(&b).unwrap()).unwrap();
        assert_eq!(
            v["messages"],
            json!([{"role": "user", "content": "count"}, {"role": "assistant", "content": "one two"}])
        );
        assert_eq!(v["continue_final_message"], json!(true));
        assert_eq!(v["add_generation_prompt"], json!(false));
        assert!(v.get("stop").is_none() && v.get("prompt").is_none());

        let t = body(None, Some(Concat("Once upon", " a time")), &pass, &[]);
        let v: Value = serde_json::from_str(&serde_json::to_string(&t).unwrap()).unwrap();
        assert_eq!(v["prompt"], json!("Once upon a time"));
        let t = body(None, Some(Concat("Once", "")), &pass, &[]);
        let v: Value = serde_json::from_str(&serde_json::to_string(&t).unwrap()).unwrap();
        assert_eq!(v["prompt"], json!("Once"));
        assert!(v.get("messages").is_none());
    }
}
