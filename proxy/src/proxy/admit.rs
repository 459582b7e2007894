//! The admission step of a request (lane, rate limits, the pool's lane
//! queue) and the refusals it sends.

use super::*;

impl EdgeProxy {
    pub(super) async fn bad_request(
        &self,
        session: &mut Session,
        ctx: &Ctx,
        why: &str,
        code: &str,
    ) -> Result<bool> {
        self.metrics.edge.rejected.with_label_values(&[code]).inc();
        policy::respond_error(session, &ctx.policy(), 400, why, code).await?;
        Ok(true)
    }

    pub(super) async fn shed(
        &self,
        session: &mut Session,
        ctx: &Ctx,
        reason: Reason,
        retry_after: Duration,
    ) -> Result<bool> {
        let lane = ctx
            .cfg
            .lanes
            .get(ctx.lane)
            .map(|l| l.name.as_str())
            .unwrap_or("");
        self.metrics.admission.shed(lane, reason.as_str());
        let (status, headers, body) = admission::refusal(reason, retry_after, None);
        let extra: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        if ctx.grpc {
            let code = super::grpc::status_for(status);
            let msg = format!("refused by the edge: {}", reason.as_str());
            policy::respond_grpc(session, &ctx.policy(), code, &msg, &extra).await?;
            return Ok(true);
        }
        let json = "application/json";
        policy::respond(session, &ctx.policy(), status, json, body, &extra).await?;
        Ok(true)
    }

    /// Rate limits of the route (the admission entry point shared with
    /// inference requests). Ok(true): refused and answered.
    pub(super) async fn rate_limited(
        &self,
        session: &mut Session,
        ctx: &Ctx,
        route: &Arc<Route>,
        pool: Option<&str>,
    ) -> Result<bool> {
        if route.limiters.is_empty() {
            return Ok(false);
        }
        let input = KeyInput {
            client_ip: session
                .client_addr()
                .and_then(|a| a.as_inet())
                .map(|a| a.ip()),
            headers: &session.req_header().headers,
            route: &route.name,
            pool,
        };
        match admission::shared::check_rates(&route.limiters, None, &input).await {
            Ok(()) | Err(Verdict::Allow) => Ok(false),
            Err(Verdict::StoreDown) => {
                self.shed(session, ctx, Reason::StoreDown, Duration::from_secs(1))
                    .await
            }
            Err(Verdict::Limited(wait)) => self.shed(session, ctx, Reason::RateLimit, wait).await,
            Err(Verdict::BadKey(why)) => {
                self.bad_request(session, ctx, why, "invalid_api_key").await
            }
        }
    }

    /// Lane, rate limits and the pool's queue. Ok(true) means a response
    /// was sent (refused); Ok(false) means go on (holding a slot if any).
    pub(super) async fn admit(
        &self,
        session: &mut Session,
        ctx: &mut Ctx,
        route: &Arc<Route>,
    ) -> Result<bool> {
        let header = session
            .req_header()
            .headers
            .get(PRIORITY_HEADER)
            .map(|v| v.as_bytes());
        ctx.lane = match admission::select_lane(&ctx.cfg.lanes, header, route.lane) {
            Ok(l) => l,
            Err(why) => {
                return self
                    .bad_request(session, ctx, &why, "invalid_priority")
                    .await
            }
        };
        let pool = match &route.action {
            Action::Proxy(p) => Some(p.clone()),
            _ => None,
        };
        if self
            .rate_limited(session, ctx, route, pool.as_ref().map(|p| p.name.as_str()))
            .await?
        {
            return Ok(true);
        }
        let Some(gate) = pool.and_then(|p| p.gate.clone()) else {
            return Ok(false);
        };
        let watch_disconnect = !filters::has_body(session.req_header());
        let lane = ctx.lane;
        let outcome = {
            // Without a body to read, an idle read only returns when the
            // client closes: that is how a queued request notices it.
            let gone = async {
                if watch_disconnect {
                    while let Ok(Some(_)) = session.read_body_or_idle(true).await {}
                } else {
                    std::future::pending::<()>().await;
                }
            };
            gate.acquire(lane, None, gone).await
        };
        match outcome {
            Ok((permit, waited)) => {
                ctx.permit = Some(permit);
                ctx.queue_wait = Some(waited);
                Ok(false)
            }
            Err(Denied::Shed(reason, retry_after)) => {
                self.shed(session, ctx, reason, retry_after).await
            }
            Err(Denied::Gone) => {
                self.metrics
                    .edge
                    .rejected
                    .with_label_values(&["client_gone"])
                    .inc();
                Err(Error::new_down(ErrorType::ConnectionClosed))
            }
        }
    }
}
