//! What a stream keeps per choice of a request for several (`n` > 1): the
//! choice its next text belongs to, whether that choice has had its first
//! chunk (a chat's first delta names the role), and its reports
//! (`logprobs`: the legacy shape's offsets run per choice). One choice is
//! the common case and costs a flag and an empty vector.

use super::logprobs::{Reports, Shape};
use serde_json::{json, Value};
use ultrafast_engine::api::TokenLogprob;

/// A stream's choices.
#[derive(Debug)]
pub struct Choices {
    /// The choice the next text, reports and end are of.
    pub index: u32,
    /// Choices asked for.
    pub n: usize,
    started: Vec<bool>,
    /// Per choice, when the request asked for `logprobs`.
    reports: Option<Vec<Reports>>,
}

impl Choices {
    /// `n` choices, with reports in `scored`'s shape when asked.
    pub fn new(n: usize, scored: Option<Shape>) -> Self {
        Choices {
            index: 0,
            n: n.max(1),
            started: vec![false; n.max(1)],
            reports: scored.map(|s| (0..n.max(1)).map(|_| Reports::new(s)).collect()),
        }
    }

    /// Several choices: chunks name their index.
    pub fn multi(&self) -> bool {
        self.n > 1
    }

    /// Whether reports are written.
    pub fn scored(&self) -> bool {
        self.reports.is_some()
    }

    /// The current choice's next chunk is its first (and now it is not).
    pub fn first(&mut self) -> bool {
        match self.started.get_mut(self.index as usize) {
            Some(s) => !std::mem::replace(s, true),
            None => false,
        }
    }

    /// Reports of the current choice's next tokens.
    pub fn add(&mut self, tokens: Vec<TokenLogprob>) {
        if let Some(r) = self.current() {
            r.add(tokens);
        }
    }

    /// Whether the current choice has reports waiting.
    pub fn waiting(&mut self) -> bool {
        self.current().is_some_and(|r| r.waiting())
    }

    fn current(&mut self) -> Option<&mut Reports> {
        let i = self.index as usize;
        self.reports.as_mut().and_then(|r| r.get_mut(i))
    }

    /// Make `v` (a chunk) the current choice's: its index and the reports
    /// waiting for it.
    pub fn fill(&mut self, v: &mut Value) {
        v["choices"][0]["index"] = json!(self.index);
        if let Some(r) = self.current() {
            v["choices"][0]["logprobs"] = r.take();
        }
    }
}
