//! Telling tool calls apart from text in a generated stream.
//!
//! The engine writes a tool call as a Hermes/Qwen2.5 block,
//! `<tool_call>{"name": "f", "arguments": {...}}</tool_call>` (its grammar
//! guarantees the shape), and the upstream relay turns an upstream's
//! `tool_calls` deltas into the same text. `Shaper` reads that text as it
//! streams and yields pieces: text, a call's start (its name known), its
//! arguments as they arrive, and its end. Each API dialect formats those
//! pieces its own way, streamed or whole, so every backend's calls reach
//! every dialect by one path.

use ultrafast_engine::guide::{CALL_CLOSE, CALL_OPEN};

/// One piece of a response's output.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    /// Answer text.
    Text(String),
    /// A tool call begins.
    CallStart {
        /// Its position among the calls of this response.
        index: usize,
        /// Its id (`call_...`), random.
        id: String,
        /// The function's name.
        name: String,
    },
    /// More of a call's arguments (JSON text).
    CallArgs {
        /// The call.
        index: usize,
        /// The text.
        delta: String,
    },
    /// A call's arguments are complete.
    CallEnd {
        /// The call.
        index: usize,
    },
}

/// A finished tool call.
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    /// `call_...`.
    pub id: String,
    /// Function name.
    pub name: String,
    /// Arguments, JSON text.
    pub arguments: String,
}

/// Everything a response said, for the dialects that answer whole.
#[derive(Debug, Clone, Default)]
pub struct Collected {
    /// Answer text.
    pub text: String,
    /// Tool calls.
    pub calls: Vec<Call>,
}

impl Collected {
    /// Add a piece.
    pub fn add(&mut self, p: &Piece) {
        match p {
            Piece::Text(t) => self.text.push_str(t),
            Piece::CallStart { id, name, .. } => self.calls.push(Call {
                id: id.clone(),
                name: name.clone(),
                arguments: String::new(),
            }),
            Piece::CallArgs { delta, .. } => {
                if let Some(c) = self.calls.last_mut() {
                    c.arguments.push_str(delta);
                }
            }
            Piece::CallEnd { .. } => {}
        }
    }
}

#[derive(Debug)]
enum State {
    /// Answer text; `held` may be the start of `<tool_call>`.
    Text,
    /// After `<tool_call>`, before the arguments (name not yet known).
    Head,
    /// Inside the arguments value.
    Args(Scan),
    /// After the arguments, up to `</tool_call>`.
    Tail,
}

/// Depth of a JSON value being read, strings and escapes aware.
#[derive(Debug, Default)]
struct Scan {
    depth: usize,
    started: bool,
    in_str: bool,
    escaped: bool,
}

impl Scan {
    /// Read `s`; the byte length consumed when the value ends in it.
    fn feed(&mut self, s: &str) -> Option<usize> {
        for (i, c) in s.char_indices() {
            if self.in_str {
                match (self.escaped, c) {
                    (true, _) => self.escaped = false,
                    (false, '\\') => self.escaped = true,
                    (false, '"') => {
                        self.in_str = false;
                        if self.depth == 0 {
                            return Some(i + 1);
                        }
                    }
                    _ => {}
                }
                continue;
            }
            match c {
                '{' | '[' => {
                    self.depth += 1;
                    self.started = true;
                }
                '}' | ']' if self.depth > 0 => {
                    self.depth -= 1;
                    if self.depth == 0 {
                        return Some(i + c.len_utf8());
                    }
                }
                '"' => {
                    self.in_str = true;
                    self.started = true;
                }
                c if c.is_whitespace() && !self.started => {}
                // A scalar value: it ends at the first delimiter.
                ',' | '}' | ']' if self.started && self.depth == 0 => return Some(i),
                _ => self.started = true,
            }
        }
        None
    }
}

/// Splits a generated stream into text and tool-call pieces.
#[derive(Debug)]
pub struct Shaper {
    state: State,
    held: String,
    calls: usize,
    open: Option<usize>,
}

impl Default for Shaper {
    fn default() -> Self {
        Shaper {
            state: State::Text,
            held: String::new(),
            calls: 0,
            open: None,
        }
    }
}

/// The longest suffix of `s` that begins `pat` (a match may still come).
fn partial_suffix(s: &str, pat: &str) -> usize {
    (1..pat.len().min(s.len() + 1))
        .rev()
        .find(|&n| s.is_char_boundary(s.len() - n) && pat.starts_with(&s[s.len() - n..]))
        .unwrap_or(0)
}

impl Shaper {
    /// How many calls were made.
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// Whether `t` is answer text: whitespace between or after calls is not.
    fn is_answer(&self, t: &str) -> bool {
        !t.trim().is_empty() || (self.calls == 0 && !t.is_empty())
    }

    /// Read more text; the pieces it completes.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.held.push_str(text);
        let mut out = Vec::new();
        while self.step(&mut out) {}
        out
    }

    /// The stream ended: what was held, and the end of a cut-off call.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.held);
        match std::mem::replace(&mut self.state, State::Text) {
            State::Text => {
                if self.is_answer(&rest) {
                    out.push(Piece::Text(rest));
                }
            }
            State::Head => self.whole_call(&rest, &mut out),
            State::Args(_) | State::Tail => {}
        }
        if let Some(index) = self.open.take() {
            out.push(Piece::CallEnd { index });
        }
        out
    }

    /// One state transition over `held`; false when it needs more text.
    fn step(&mut self, out: &mut Vec<Piece>) -> bool {
        match &mut self.state {
            State::Text => {
                if let Some(at) = self.held.find(CALL_OPEN) {
                    let before: String = self.held.drain(..at + CALL_OPEN.len()).collect();
                    let text = &before[..at];
                    // Whitespace between calls is not answer text.
                    if self.is_answer(text) {
                        out.push(Piece::Text(text.to_string()));
                    }
                    self.state = State::Head;
                    return true;
                }
                let keep = partial_suffix(&self.held, CALL_OPEN);
                let emit = self.held.len() - keep;
                if emit > 0 {
                    let text: String = self.held.drain(..emit).collect();
                    if self.is_answer(&text) {
                        out.push(Piece::Text(text));
                    }
                }
                false
            }
            State::Head => {
                let Some((head_len, name)) = name_first(&self.held) else {
                    if let Some(end) = self.held.find(CALL_CLOSE) {
                        // A call whose name did not come first: read it whole.
                        let body: String = self.held.drain(..end + CALL_CLOSE.len()).collect();
                        self.whole_call(&body[..end], out);
                        self.state = State::Text;
                        return true;
                    }
                    return false;
                };
                self.held.drain(..head_len);
                let index = self.calls;
                self.calls += 1;
                self.open = Some(index);
                out.push(Piece::CallStart {
                    index,
                    id: call_id(),
                    name,
                });
                self.state = State::Args(Scan::default());
                true
            }
            State::Args(scan) => {
                let index = self.open.unwrap_or(0);
                if !scan.started {
                    let ws = self.held.len() - self.held.trim_start().len();
                    self.held.drain(..ws);
                }
                match scan.feed(&self.held) {
                    Some(n) => {
                        let delta: String = self.held.drain(..n).collect();
                        if !delta.is_empty() {
                            out.push(Piece::CallArgs { index, delta });
                        }
                        out.push(Piece::CallEnd { index });
                        self.open = None;
                        self.state = State::Tail;
                        true
                    }
                    None => {
                        let delta = std::mem::take(&mut self.held);
                        if !delta.is_empty() {
                            out.push(Piece::CallArgs { index, delta });
                        }
                        false
                    }
                }
            }
            State::Tail => match self.held.find(CALL_CLOSE) {
                Some(end) => {
                    self.held.drain(..end + CALL_CLOSE.len());
                    self.state = State::Text;
                    true
                }
                None => false,
            },
        }
    }

    /// A whole call's JSON at once (any key order).
    fn whole_call(&mut self, body: &str, out: &mut Vec<Piece>) {
        let v: serde_json::Value = serde_json::from_str(body.trim()).unwrap_or_default();
        let name = v["name"].as_str().unwrap_or_default().to_string();
        let args = match &v["arguments"] {
            serde_json::Value::Null => "{}".to_string(),
            a => a.to_string(),
        };
        let index = self.calls;
        self.calls += 1;
        out.push(Piece::CallStart {
            index,
            id: call_id(),
            name,
        });
        out.push(Piece::CallArgs { index, delta: args });
        out.push(Piece::CallEnd { index });
    }
}

/// A call's head when its name comes before its arguments, as the engine's
/// grammar writes it: the head's length (through `"arguments":`) and the
/// name.
fn name_first(held: &str) -> Option<(usize, String)> {
    const KEY: &str = "\"arguments\"";
    let key = held.find(KEY)?;
    let colon = held[key + KEY.len()..].find(':')?;
    let head_len = key + KEY.len() + colon + 1;
    let head = format!("{}null}}", &held[..head_len]);
    let v: serde_json::Value = serde_json::from_str(head.trim()).ok()?;
    Some((head_len, v["name"].as_str()?.to_string()))
}

/// A fresh, random call id.
pub fn call_id() -> String {
    let id = super::jobs::random_id();
    format!("call_{}", id.trim_start_matches("req_"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(chunks: &[&str]) -> (Collected, Vec<Piece>) {
        let mut s = Shaper::default();
        let mut all = Vec::new();
        for c in chunks {
            all.extend(s.push(c));
        }
        all.extend(s.finish());
        let mut col = Collected::default();
        for p in &all {
            col.add(p);
        }
        (col, all)
    }

    #[test]
    fn text_alone_passes_through() {
        let (c, _) = run(&["Hello", " <b>wor", "ld</b>", " <tool"]);
        assert_eq!(c.text, "Hello <b>world</b> <tool");
        assert!(c.calls.is_empty());
    }

    #[test]
    fn a_call_split_anywhere_gives_the_same_pieces() {
        let text = r#"<tool_call>{"name": "get_weather", "arguments": {"city": "Paris \"}\" x", "days": [1, 2]}}</tool_call>
<tool_call>{"name": "f", "arguments": {}}</tool_call>"#;
        for cut in 1..text.len() {
            if !text.is_char_boundary(cut) {
                continue;
            }
            let (c, pieces) = run(&[&text[..cut], &text[cut..]]);
            assert_eq!(c.text, "", "cut {cut}");
            assert_eq!(c.calls.len(), 2, "cut {cut}: {pieces:?}");
            assert_eq!(c.calls[0].name, "get_weather");
            assert_eq!(
                c.calls[0].arguments,
                r#"{"city": "Paris \"}\" x", "days": [1, 2]}"#
            );
            assert_eq!(
                (c.calls[1].name.as_str(), c.calls[1].arguments.as_str()),
                ("f", "{}")
            );
            assert_eq!(
                pieces
                    .iter()
                    .filter(|p| matches!(p, Piece::CallEnd { .. }))
                    .count(),
                2
            );
        }
    }

    #[test]
    fn text_then_a_call_and_a_call_in_any_key_order() {
        let (c, _) = run(&["Let me check.\n<tool_call>\n{\"arguments\": {\"a\": 1}, \"name\": \"g\"}\n</tool_call>"]);
        assert_eq!(c.text, "Let me check.\n");
        assert_eq!(c.calls[0].name, "g");
        assert_eq!(c.calls[0].arguments, r#"{"a":1}"#);
    }

    #[test]
    fn a_call_cut_off_still_ends() {
        let (c, pieces) = run(&[r#"<tool_call>{"name": "f", "arguments": {"a": "#]);
        assert_eq!(c.calls[0].arguments, r#"{"a": "#);
        assert_eq!(pieces.last(), Some(&Piece::CallEnd { index: 0 }));
    }
}
