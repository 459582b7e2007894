//! Token cadence smoothing: a pacer between the backend and the socket.
//!
//! Backends produce tokens in bursts (batch steps, network coalescing); a
//! reader sees a stutter. The pacer holds tokens briefly and releases them
//! on a steady clock: the first token is never delayed, at most `max_lead`
//! tokens are held (beyond that they go at once, so a slow pacer never
//! builds up latency), a schedule that fell behind catches up with a short
//! burst, and the end of the stream flushes everything immediately. In
//! adaptive mode the interval follows the measured generation rate, so the
//! buffer neither drains nor grows. Pure logic over given instants, so it is
//! tested without sleeping.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// How a lane paces its streams.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PaceMode {
    /// Tokens go out as they come.
    Off,
    /// One token per interval.
    Fixed(Duration),
    /// One token per measured generation interval, never faster than `min`.
    Adaptive {
        /// Shortest interval.
        min: Duration,
    },
}

/// A lane's pacing settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PaceSpec {
    /// Mode.
    pub mode: PaceMode,
    /// Tokens held back at most.
    pub max_lead: usize,
}

impl PaceSpec {
    /// No pacing.
    pub const OFF: PaceSpec = PaceSpec {
        mode: PaceMode::Off,
        max_lead: 0,
    };
}

/// The pacer of one stream.
#[derive(Debug)]
pub struct Pacer<T> {
    spec: PaceSpec,
    buf: VecDeque<T>,
    next_due: Option<Instant>,
    last_arrival: Option<Instant>,
    ewma_gap_s: Option<f64>,
}

impl<T> Pacer<T> {
    /// A pacer with these settings.
    pub fn new(spec: PaceSpec) -> Self {
        Pacer {
            spec,
            buf: VecDeque::new(),
            next_due: None,
            last_arrival: None,
            ewma_gap_s: None,
        }
    }

    /// The current interval between releases.
    pub fn interval(&self) -> Duration {
        match self.spec.mode {
            PaceMode::Off => Duration::ZERO,
            PaceMode::Fixed(d) => d,
            PaceMode::Adaptive { min } => {
                // Slightly faster than production, so the buffer drains.
                let gap = self.ewma_gap_s.unwrap_or(0.0) * 0.95;
                Duration::from_secs_f64(gap.min(1.0)).max(min)
            }
        }
    }

    /// A token arrived from the backend.
    pub fn push(&mut self, item: T, now: Instant) {
        if let Some(prev) = self.last_arrival {
            // Only gaps after the first token: the first gap is prefill.
            if self.next_due.is_some() {
                let gap = now.saturating_duration_since(prev).as_secs_f64();
                self.ewma_gap_s = Some(match self.ewma_gap_s {
                    None => gap,
                    Some(e) => e * 0.9 + gap * 0.1,
                });
            }
        }
        self.last_arrival = Some(now);
        self.buf.push_back(item);
    }

    /// Tokens held now.
    pub fn held(&self) -> usize {
        self.buf.len()
    }

    /// The next token to write now, if one is due.
    pub fn pop_due(&mut self, now: Instant) -> Option<T> {
        if self.buf.is_empty() {
            return None;
        }
        let interval = self.interval();
        let Some(due) = self.next_due else {
            // The first token is never delayed.
            self.next_due = Some(now + interval);
            return self.buf.pop_front();
        };
        if self.spec.mode == PaceMode::Off || self.buf.len() > self.spec.max_lead {
            return self.buf.pop_front();
        }
        if now < due {
            return None;
        }
        // A schedule more than one interval behind restarts one interval
        // back: a burst of at most two, not of everything owed.
        let next = (due + interval).max(now.checked_sub(interval).unwrap_or(now));
        self.next_due = Some(next);
        self.buf.pop_front()
    }

    /// When `pop_due` will next return a token (None: nothing held).
    pub fn deadline(&self, now: Instant) -> Option<Instant> {
        if self.buf.is_empty() {
            return None;
        }
        match self.next_due {
            Some(d) if self.spec.mode != PaceMode::Off && self.buf.len() <= self.spec.max_lead => {
                Some(d.max(now))
            }
            _ => Some(now),
        }
    }

    /// Everything held, for the end of the stream.
    pub fn drain(&mut self) -> impl Iterator<Item = T> + '_ {
        self.buf.drain(..)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// Feed arrivals (ms offsets), run the pacer on a 1 ms clock, return
    /// release times.
    fn run(spec: PaceSpec, arrivals: &[u64], end: u64) -> Vec<u64> {
        let t0 = Instant::now();
        let mut p = Pacer::new(spec);
        let mut out = Vec::new();
        let mut next = 0;
        for t in 0..=end {
            let now = t0 + ms(t);
            while next < arrivals.len() && arrivals[next] == t {
                p.push(next, now);
                next += 1;
            }
            while p.pop_due(now).is_some() {
                out.push(t);
            }
        }
        out
    }

    #[test]
    fn fixed_pacing_smooths_bursts_and_never_delays_the_first_token() {
        // Bursts of 4 tokens every 80 ms (20 ms per token on average).
        let arrivals: Vec<u64> = (0..5).flat_map(|b| [100 + b * 80; 4]).collect();
        let spec = PaceSpec {
            mode: PaceMode::Fixed(ms(20)),
            max_lead: 8,
        };
        let out = run(spec, &arrivals, 1000);
        assert_eq!(out.len(), 20);
        assert_eq!(out[0], 100, "first token released on arrival");
        let gaps: Vec<u64> = out.windows(2).map(|w| w[1] - w[0]).collect();
        assert!(gaps.iter().all(|&g| g == 20), "{gaps:?}");
    }

    #[test]
    fn lead_is_bounded() {
        // 30 tokens at once: at most max_lead held, the rest go at once.
        let arrivals = vec![10u64; 30];
        let spec = PaceSpec {
            mode: PaceMode::Fixed(ms(50)),
            max_lead: 5,
        };
        let out = run(spec, &arrivals, 2000);
        assert_eq!(out.iter().filter(|&&t| t == 10).count(), 25);
        assert_eq!(out.len(), 30);
    }

    #[test]
    fn adaptive_follows_the_generation_rate() {
        // Pairs of tokens every 60 ms: 30 ms per token.
        let arrivals: Vec<u64> = (0..20).flat_map(|b| [50 + b * 60; 2]).collect();
        let spec = PaceSpec {
            mode: PaceMode::Adaptive { min: ms(5) },
            max_lead: 8,
        };
        let out = run(spec, &arrivals, 3000);
        assert_eq!(out.len(), 40);
        let late: Vec<u64> = out[20..].windows(2).map(|w| w[1] - w[0]).collect();
        let mean = late.iter().sum::<u64>() as f64 / late.len() as f64;
        assert!((20.0..=34.0).contains(&mean), "mean {mean} {late:?}");
        assert!(late.iter().all(|&g| g > 0 && g < 45), "{late:?}");
    }

    #[test]
    fn off_passes_through() {
        let out = run(PaceSpec::OFF, &[1, 1, 1, 5], 10);
        assert_eq!(out, vec![1, 1, 1, 5]);
    }
}
