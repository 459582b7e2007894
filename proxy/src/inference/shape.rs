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
    /// Bytes of `held` already searched (in `Head` and `Tail`) without a
    /// match: the next search resumes there, so a long call is read once,
    /// not again on every token.
    searched: usize,
    /// In `Head`: the call's head was read and its name is not first.
    head_failed: bool,
    /// Bytes searched in all, for the test that reading is linear.
    #[cfg(test)]
    work: usize,
}

impl Default for Shaper {
    fn default() -> Self {
        Shaper {
            state: State::Text,
            held: String::new(),
            calls: 0,
            open: None,
            searched: 0,
            head_failed: false,
            #[cfg(test)]
            work: 0,
        }
    }
}

/// The key after which a call's arguments come.
const ARGS_KEY: &str = "\"arguments\"";

/// The longest pattern a resumed search looks for (`ARGS_KEY`,
/// `CALL_CLOSE`).
const LONGEST: usize = if ARGS_KEY.len() > CALL_CLOSE.len() {
    ARGS_KEY.len()
} else {
    CALL_CLOSE.len()
};

/// Where a search of `s` resumes when its first `searched` bytes held no
/// match: back by `LONGEST - 1` (a match may straddle), onto a character
/// boundary.
fn resume(s: &str, searched: usize) -> usize {
    let mut at = searched.saturating_sub(LONGEST - 1).min(s.len());
    while !s.is_char_boundary(at) {
        at -= 1;
    }
    at
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

    /// Enter `state`: what was searched of `held` no longer applies.
    fn enter(&mut self, state: State) {
        self.state = state;
        self.searched = 0;
        self.head_failed = false;
    }

    /// Search `held` for `pat` from where the last search left off.
    fn find_on(&mut self, pat: &str) -> Option<usize> {
        let from = resume(&self.held, self.searched);
        #[cfg(test)]
        {
            self.work += self.held.len() - from;
        }
        self.held[from..].find(pat).map(|i| i + from)
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
                    self.enter(State::Head);
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
                let mut keyed = None;
                let first = if self.head_failed {
                    None
                } else {
                    match name_first(&self.held, resume(&self.held, self.searched)) {
                        Head::Named(len, name) => Some((len, name)),
                        Head::NotYet => None,
                        Head::Keyed(at) => {
                            keyed = Some(at);
                            None
                        }
                        Head::Unnamed => {
                            self.head_failed = true;
                            None
                        }
                    }
                };
                let Some((head_len, name)) = first else {
                    if let Some(end) = self.find_on(CALL_CLOSE) {
                        // A call whose name did not come first: read it whole.
                        let body: String = self.held.drain(..end + CALL_CLOSE.len()).collect();
                        self.whole_call(&body[..end], out);
                        self.enter(State::Text);
                        return true;
                    }
                    // Its colon not yet come, the key is looked at again.
                    self.searched = keyed.unwrap_or(self.held.len());
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
                self.enter(State::Args(Scan::default()));
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
                        self.enter(State::Tail);
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
            State::Tail => match self.find_on(CALL_CLOSE) {
                Some(end) => {
                    self.held.drain(..end + CALL_CLOSE.len());
                    self.enter(State::Text);
                    true
                }
                None => {
                    self.searched = self.held.len();
                    false
                }
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

/// What the start of a call says of its name.
enum Head {
    /// The name came first, as the engine's grammar writes it: the head's
    /// length (through `"arguments":`) and the name.
    Named(usize, String),
    /// `"arguments"` has not come yet.
    NotYet,
    /// `"arguments"` came, at this byte, and its colon not yet.
    Keyed(usize),
    /// The head came and holds no name: the call is read whole.
    Unnamed,
}

/// The call's head in `held`, its `"arguments"` key looked for from `from`
/// on (what came before was searched already).
fn name_first(held: &str, from: usize) -> Head {
    let Some(key) = held[from..].find(ARGS_KEY).map(|k| k + from) else {
        return Head::NotYet;
    };
    let Some(colon) = held[key + ARGS_KEY.len()..].find(':') else {
        return Head::Keyed(key);
    };
    let head_len = key + ARGS_KEY.len() + colon + 1;
    let head = format!("{}null}}", &held[..head_len]);
    let name = serde_json::from_str::<serde_json::Value>(head.trim())
        .ok()
        .and_then(|v| v["name"].as_str().map(str::to_string));
    match name {
        Some(n) => Head::Named(head_len, n),
        None => Head::Unnamed,
    }
}

/// A fresh, random call id.
pub fn call_id() -> String {
    let id = super::jobs::random_id();
    format!("call_{}", id.trim_start_matches("req_"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_call_read_a_byte_at_a_time_is_searched_once() {
        // Arguments before the name (read whole at the close), and a long
        // tail of junk after a call: each byte searched a bounded number of
        // times, not once per token.
        let args = format!("{{\"q\": \"{}\"}}", "x".repeat(20_000));
        let text = format!(
            "<tool_call>{{\"arguments\": {args}, \"name\": \"f\"}}</tool_call>\
             <tool_call>{{\"name\": \"g\", \"arguments\": {{}}}}{}</tool_call>",
            " ".repeat(20_000)
        );
        let mut sh = Shaper::default();
        let mut col = Collected::default();
        let mut i = 0;
        while i < text.len() {
            let n = (i + 1..=text.len())
                .find(|&e| text.is_char_boundary(e))
                .unwrap();
            for p in sh.push(&text[i..n]) {
                col.add(&p);
            }
            i = n;
        }
        for p in sh.finish() {
            col.add(&p);
        }
        assert_eq!(col.calls.len(), 2);
        assert_eq!(col.calls[0].name, "f");
        assert_eq!(col.calls[1].name, "g");
        assert!(
            sh.work <= 20 * text.len(),
            "{} bytes searched for {}",
            sh.work,
            text.len()
        );
    }

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
