//! The limits of an inference request, in the order that keeps refusals
//! cheap: before the body is read, the route's request-rate limits and the
//! API key (who is asking, and its own request rate) on every `/v1/`
//! endpoint; after parsing, the key's right to the model; after the backend
//! sized the request, its token budgets (the route's and the key's):
//! prompt plus `max_tokens` reserved now, settled to the real usage at the
//! end.

use super::context::Incoming;
use super::delivery::Failure;
use super::metrics::InferenceMetrics;
use super::Front;
use crate::admission::budget::{BudgetRefusal, Reservation};
use crate::admission::keys::KeyEntry;
use crate::admission::queue::Reason;
use crate::admission::ratelimit::{KeyInput, Verdict};
use crate::admission::refusal;
use crate::admission::shared::{self, check_rates, Want};
use crate::cluster::OnStoreError;
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
    /// Limits that need no body: the route's request rates and the API
    /// key's own rate, as one decision (`admission::shared`). Ok: the
    /// caller's key (None without keys). A rate refusal comes before a bad
    /// key, as a refusal that costs the least.
    pub async fn limits(
        &self,
        metrics: &InferenceMetrics,
        inc: &Incoming,
        lane: &str,
    ) -> Result<Option<Arc<KeyEntry>>, Failure> {
        if fair_store_closed(inc) {
            metrics.admission.shed(lane, Reason::StoreDown.as_str());
            return Err(store_down());
        }
        let key = match &inc.cfg.api_keys() {
            None => Ok(None),
            Some(keys) => keys.authenticate(&inc.headers).map(Some),
        };
        let key_ref = match &key {
            Ok(Some(k)) => Some((k.as_ref(), key_mode(inc))),
            _ => None,
        };
        match check_rates(&inc.route.limiters, key_ref, &input(inc)).await {
            Ok(()) | Err(Verdict::Allow) => {}
            Err(Verdict::Limited(wait)) => {
                metrics.admission.shed(lane, Reason::RateLimit.as_str());
                return Err(rate_refusal(wait));
            }
            Err(Verdict::StoreDown) => {
                metrics.admission.shed(lane, Reason::StoreDown.as_str());
                return Err(store_down());
            }
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
        key.map_err(|e| {
            metrics
                .rejected
                .with_label_values(&["invalid_api_key"])
                .inc();
            let (status, code, message) = e.response();
            unauthorized(status, code, message)
        })
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

    /// The lane `lane` grants this request (see `slo::grant`): its key's
    /// `lanes`, or the route's `anonymous_lanes` for a request without a
    /// key.
    pub fn granted_lane(
        &self,
        inc: &Incoming,
        lane: usize,
        granted: Option<&[bool]>,
    ) -> Result<usize, BackendError> {
        // Named only for the refusal: no allocation on the way through.
        let who = || match &inc.key {
            Some(k) => format!("The API key `{}`", k.name),
            None => "A request without an API key".into(),
        };
        super::slo::grant(inc.cfg.lanes(), lane, granted, who)
    }

    /// Which lanes (by index) this request may use: its key's `lanes`, or
    /// the route's `anonymous_lanes` without a key; None: all.
    pub fn granted_lanes(&self, inc: &Incoming) -> Option<Vec<bool>> {
        let lanes = inc.cfg.lanes();
        match &inc.key {
            Some(k) => k
                .lanes
                .as_ref()
                .map(|names| lanes.iter().map(|l| names.contains(&l.name)).collect()),
            None => inc
                .route
                .anonymous_lanes
                .as_ref()
                .map(|allowed| (0..lanes.len()).map(|l| allowed.contains(&l)).collect()),
        }
    }

    /// Reserve `tokens` (prompt plus `max_tokens`) from every token budget
    /// of the route and of the key; all or nothing, one decision.
    pub async fn reserve(
        &self,
        metrics: &InferenceMetrics,
        inc: &Incoming,
        lane: &str,
        tokens: u64,
    ) -> Result<Held, Failure> {
        let input = input(inc);
        let mut wants = Vec::with_capacity(inc.route.budgets.len() + 1);
        for b in &inc.route.budgets {
            let key = b.key(&input).map_err(|why| {
                super::sinks::backend_failure(&BackendError::invalid(
                    "invalid_api_key",
                    None,
                    why.to_string(),
                ))
            })?;
            wants.push(Want {
                budget: b,
                key,
                api_key: None,
                mode: b.on_store_error,
            });
        }
        if let Some(k) = &inc.key {
            if let Some(b) = &k.budget {
                wants.push(Want {
                    budget: b,
                    key: 0,
                    api_key: Some(&k.name),
                    mode: key_mode(inc),
                });
            }
        }
        if wants.is_empty() {
            return Ok(Held::default());
        }
        // Boxed: the shared store's state is large and rarely needed.
        Box::pin(shared::reserve(&wants, tokens))
            .await
            .map(Held)
            .map_err(|r| {
            metrics.admission.shed(lane, "token_budget");
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
                BudgetRefusal::StoreDown => store_down(),
            }
        })
    }
}

/// `[api_keys] on_store_error` of the live config.
fn key_mode(inc: &Incoming) -> OnStoreError {
    inc.cfg
        .file()
        .api_keys
        .as_ref()
        .and_then(|a| OnStoreError::parse(&a.on_store_error))
        .unwrap_or(OnStoreError::Local)
}

/// A limit that fails closed while the shared store is down: a 503.
/// Whether fair shares refuse now: `[cluster] fair_on_store_error =
/// "closed"` with the store down (see `cluster::fair`).
fn fair_store_closed(inc: &Incoming) -> bool {
    inc.cfg.fair_closed() && crate::cluster::get().is_some_and(|c| !c.is_up())
}

fn store_down() -> Failure {
    let (status, headers, body) = refusal(Reason::StoreDown, Duration::from_secs(1), None);
    Failure {
        status,
        headers,
        body,
    }
}

fn why_str(why: &'static str) -> String {
    if why.is_empty() {
        "malformed request key".into()
    } else {
        why.to_string()
    }
}
