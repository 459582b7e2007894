//! The limits of an inference request, in the order that keeps refusals
//! cheap: before the body is read, the route's request-rate limits and the
//! API key (who is asking, and its own request rate) on every `/v1/`
//! endpoint; after parsing, the key's right to the model; after the backend
//! sized the request, its token budgets (the route's and the key's):
//! prompt plus `max_tokens` reserved now, settled to the real usage at the
//! end.

use super::drive::Failure;
use super::pipeline::Incoming;
use super::Front;
use crate::admission::budget::{BudgetRefusal, Reservation};
use crate::admission::keys::KeyEntry;
use crate::admission::queue::Reason;
use crate::admission::ratelimit::{KeyInput, Verdict};
use crate::admission::{check_limits, refusal};
use crate::metrics::Metrics;
use std::sync::Arc;
use std::time::Duration;
use ultrafast_engine::api::BackendError;

/// Token reservations held by a running request; released (refunded) when
/// dropped unsettled, so an exit that forgets to settle refunds all.
#[derive(Debug, Default)]
pub struct Held(Vec<Reservation>);

impl Held {
    /// The request used `used` tokens: refund the rest of each reservation.
    pub fn settle(self, used: u64) {
        for r in self.0 {
            r.settle(used);
        }
    }
}

fn rate_refusal(wait: Duration) -> Failure {
    let (status, headers, body) = refusal(Reason::RateLimit, wait, None);
    Failure {
        status,
        headers,
        body,
    }
}

fn input(inc: &Incoming) -> KeyInput<'_> {
    KeyInput {
        client_ip: inc.client_ip,
        headers: &inc.headers,
        route: &inc.route.name,
        pool: None,
    }
}

fn unauthorized(status: u16, code: &'static str, message: String) -> Failure {
    let e = BackendError::request(status, code, message);
    let mut f = super::sinks::backend_failure(&e);
    if status == 401 {
        f.headers
            .push(("www-authenticate", "Bearer realm=\"ultrafast\"".into()));
    }
    f
}

impl Front {
    /// Limits that need no body: the route's request rates, then the API
    /// key and its own rate. Ok: the caller's key (None without keys).
    pub fn limits(
        &self,
        metrics: &Metrics,
        inc: &Incoming,
        lane: &str,
    ) -> Result<Option<Arc<KeyEntry>>, Failure> {
        match check_limits(&inc.route.limiters, &input(inc)) {
            Ok(()) => {}
            Err(Verdict::Limited(wait)) => {
                metrics.shed(lane, Reason::RateLimit.as_str());
                return Err(rate_refusal(wait));
            }
            Err(Verdict::Allow) => {}
            Err(Verdict::BadKey(why)) => {
                metrics
                    .rejected
                    .with_label_values(&["invalid_api_key"])
                    .inc();
                return Err(super::sinks::backend_failure(&BackendError::invalid(
                    "invalid_api_key",
                    None,
                    why_str(why),
                )));
            }
        }
        let Some(keys) = &inc.cfg.api_keys else {
            return Ok(None);
        };
        let key = keys.authenticate(&inc.headers).map_err(|e| {
            metrics
                .rejected
                .with_label_values(&["invalid_api_key"])
                .inc();
            let (status, code, message) = e.response();
            unauthorized(status, code, message)
        })?;
        if let Err(wait) = key.check_rate() {
            metrics.shed(lane, Reason::RateLimit.as_str());
            return Err(rate_refusal(wait));
        }
        Ok(Some(key))
    }

    /// Whether the caller's key may use `model` (403 otherwise).
    pub fn allowed(&self, inc: &Incoming, model: &str) -> Result<(), BackendError> {
        match &inc.key {
            Some(k) if !k.allows_model(model) => Err(BackendError {
                status: 403,
                kind: "invalid_request_error",
                code: "model_not_allowed",
                param: Some("model"),
                message: format!("The API key `{}` may not use the model `{model}`.", k.name),
            }),
            _ => Ok(()),
        }
    }

    /// Reserve `tokens` (prompt plus `max_tokens`) from every token budget
    /// of the route and of the key; all or nothing.
    pub fn reserve(
        &self,
        metrics: &Metrics,
        inc: &Incoming,
        lane: &str,
        tokens: u64,
    ) -> Result<Held, Failure> {
        let mut held = Held::default();
        let refused = |r: BudgetRefusal| -> Failure {
            metrics.shed(lane, "token_budget");
            match r {
                BudgetRefusal::Wait { retry_after } => {
                    let (status, headers, body) =
                        refusal(Reason::TokenBudget, retry_after, None);
                    Failure {
                        status,
                        headers,
                        body,
                    }
                }
                BudgetRefusal::TooLarge { tokens, burst } => {
                    super::sinks::backend_failure(&BackendError::request(
                        429,
                        "token_budget",
                        format!("this request needs {tokens} tokens (prompt plus max_tokens), more than the budget ever holds ({burst}); lower max_tokens"),
                    ))
                }
            }
        };
        let input = input(inc);
        for b in &inc.route.budgets {
            let key = b.key(&input).map_err(|why| {
                super::sinks::backend_failure(&BackendError::invalid(
                    "invalid_api_key",
                    None,
                    why.to_string(),
                ))
            })?;
            held.0.push(b.reserve(key, tokens).map_err(refused)?);
        }
        if let Some(k) = &inc.key {
            if let Some(r) = k.reserve_tokens(tokens).map_err(refused)? {
                held.0.push(r);
            }
        }
        Ok(held)
    }
}

fn why_str(why: &'static str) -> String {
    if why.is_empty() {
        "malformed request key".into()
    } else {
        why.to_string()
    }
}
