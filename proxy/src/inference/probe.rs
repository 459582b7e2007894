//! The watchdog's synthetic probes and the background service that judges
//! the windows. A probe is a short chat prompt sent straight to the
//! model's backend (no admission, no user metrics) with the judged lane's
//! rank; its time to first token and inter-token intervals go into that
//! lane's windows. A probe that fails, or has no first token within its
//! timeout, counts as taking the whole timeout: a backend that stopped
//! answering is as bad as one that is slow.

use super::watchdog::Probe;
use super::Front;
use std::time::Instant;
use ultrafast_engine::api::{Event, InferenceRequest, Prompt};
use ultrafast_engine::sampling::SamplingParams;
use ultrafast_engine::tokenizer::ChatMessage;

/// Send one probe (the runtime's watchdog loop) and record what it measured.
pub async fn send(front: &Front, cfg: &dyn super::live::Live, p: &Probe) {
    let Some(model) = cfg.models().get(&p.model) else {
        return;
    };
    let Some(backend) = front.engines.backend(model) else {
        return;
    };
    let req = InferenceRequest {
        model: p.model.clone(),
        prompt: Prompt::Chat(vec![ChatMessage::new("user", "Reply with one word: ping")]),
        max_tokens: Some(p.max_tokens),
        n: 1,
        sampling: SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        },
        stop: Vec::new(),
        lane: "probe".into(),
        lane_rank: p.rank,
        tenant: None,
        request_id: format!("probe-{}", super::jobs::random_id()),
        traceparent: None,
        user: None,
        structure: None,
        passthrough: Default::default(),
        raw_sse: None,
    };
    let t0 = Instant::now();
    let prepared = {
        let (b, r) = (backend.clone(), req.clone());
        tokio::task::spawn_blocking(move || b.prepare(&r)).await
    };
    let Ok(Ok(prepared)) = prepared else {
        p.watch.lock().ttft(p.timeout);
        return;
    };
    let first = tokio::time::timeout(p.timeout, async {
        let mut rx = backend.generate(req, prepared).await.ok()?;
        loop {
            match rx.recv().await? {
                Event::Token { text, .. } if !text.is_empty() => return Some(rx),
                Event::Token { .. } | Event::Raw { .. } => continue,
                Event::Prompt(_) | Event::Logprob(_) | Event::Indexed(..) => continue,
                Event::Done { .. } | Event::Error(_) => return None,
            }
        }
    })
    .await;
    let Ok(Some(mut rx)) = first else {
        p.watch.lock().ttft(p.timeout);
        return;
    };
    p.watch.lock().ttft(t0.elapsed());
    // The rest (a token or two) gives inter-token samples.
    let mut prev = Instant::now();
    while let Ok(Some(ev)) = tokio::time::timeout(p.timeout, rx.recv()).await {
        match ev {
            Event::Token { text, .. } if !text.is_empty() => {
                p.watch.lock().itl(prev.elapsed());
                prev = Instant::now();
            }
            Event::Token { .. } | Event::Raw { .. } => {}
            Event::Prompt(_) | Event::Logprob(_) | Event::Indexed(..) => {}
            Event::Done { .. } | Event::Error(_) => break,
        }
    }
}
