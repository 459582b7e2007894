//! Session-ticket keys that rotate on a schedule.
//!
//! Time is cut into periods of `rotation` length; the key of period n is
//! HMAC-SHA256(secret, n). A ticket carries its period and is sealed with
//! ChaCha20-Poly1305 under that period's key; it is accepted in its own
//! period and the next one, so every key is used for one period and still
//! accepted for one more, then forgotten. Because keys derive from the
//! secret and the clock alone, instances that share a secret (a key file)
//! resume each other's sessions with no coordination, and rotation needs no
//! timer or reload. Without a key file the secret is random per process and
//! lives only in memory.

use prometheus::IntCounter;
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, CHACHA20_POLY1305, NONCE_LEN};
use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Counters of ticket use.
#[derive(Clone)]
pub struct TicketMetrics {
    /// Tickets issued.
    pub issued: IntCounter,
    /// Tickets that resumed a session.
    pub resumed: IntCounter,
    /// Tickets refused (key retired, or not ours).
    pub rejected: IntCounter,
}

/// A `rustls` ticketer with time-derived rotating keys.
pub struct RotatingTicketer {
    secret: hmac::Key,
    rotation_s: u64,
    rng: SystemRandom,
    metrics: TicketMetrics,
    /// Test hook: seconds added to the clock.
    skew_s: u64,
}

impl std::fmt::Debug for RotatingTicketer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RotatingTicketer(every {} s)", self.rotation_s)
    }
}

pub use crate::config::validate::read_ticket_key_file as read_key_file;

impl RotatingTicketer {
    /// A ticketer from a secret (or a random one) rotating every `rotation`.
    pub fn new(
        secret: Option<Vec<u8>>,
        rotation: Duration,
        metrics: TicketMetrics,
    ) -> Result<Self, String> {
        let rng = SystemRandom::new();
        let secret = match secret {
            Some(s) => s,
            None => {
                let mut s = vec![0u8; 32];
                rng.fill(&mut s)
                    .map_err(|_| "no system randomness".to_string())?;
                s
            }
        };
        Ok(RotatingTicketer {
            secret: hmac::Key::new(hmac::HMAC_SHA256, &secret),
            rotation_s: rotation.as_secs().max(1),
            rng,
            metrics,
            skew_s: 0,
        })
    }

    /// Shift this ticketer's clock (tests of rotation).
    pub fn with_skew(mut self, skew: Duration) -> Self {
        self.skew_s = skew.as_secs();
        self
    }

    fn period(&self) -> u64 {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        (now + self.skew_s) / self.rotation_s
    }

    fn key(&self, period: u64) -> Option<LessSafeKey> {
        let mut msg = b"ultrafast ticket key ".to_vec();
        msg.extend_from_slice(&period.to_be_bytes());
        let tag = hmac::sign(&self.secret, &msg);
        let unbound = UnboundKey::new(&CHACHA20_POLY1305, &tag.as_ref()[..32]).ok()?;
        Some(LessSafeKey::new(unbound))
    }
}

impl rustls::server::ProducesTickets for RotatingTicketer {
    fn enabled(&self) -> bool {
        true
    }

    fn lifetime(&self) -> u32 {
        (self.rotation_s * 2).min(u32::MAX as u64) as u32
    }

    fn encrypt(&self, plain: &[u8]) -> Option<Vec<u8>> {
        let period = self.period();
        let key = self.key(period)?;
        let mut nonce = [0u8; NONCE_LEN];
        self.rng.fill(&mut nonce).ok()?;
        let mut out = Vec::with_capacity(8 + NONCE_LEN + plain.len() + 16);
        out.extend_from_slice(&period.to_be_bytes());
        out.extend_from_slice(&nonce);
        let mut body = plain.to_vec();
        key.seal_in_place_append_tag(
            Nonce::assume_unique_for_key(nonce),
            Aad::from(period.to_be_bytes()),
            &mut body,
        )
        .ok()?;
        out.extend_from_slice(&body);
        self.metrics.issued.inc();
        Some(out)
    }

    fn decrypt(&self, cipher: &[u8]) -> Option<Vec<u8>> {
        let result = (|| {
            let period = u64::from_be_bytes(cipher.get(..8)?.try_into().ok()?);
            let now = self.period();
            // The period is the client's bytes: no arithmetic on it may
            // overflow.
            if period != now && period.checked_add(1) != Some(now) {
                return None;
            }
            let nonce: [u8; NONCE_LEN] = cipher.get(8..8 + NONCE_LEN)?.try_into().ok()?;
            let mut body = cipher.get(8 + NONCE_LEN..)?.to_vec();
            let key = self.key(period)?;
            let plain = key
                .open_in_place(
                    Nonce::assume_unique_for_key(nonce),
                    Aad::from(period.to_be_bytes()),
                    &mut body,
                )
                .ok()?;
            Some(plain.to_vec())
        })();
        match &result {
            Some(_) => self.metrics.resumed.inc(),
            None => self.metrics.rejected.inc(),
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::server::ProducesTickets;

    fn metrics() -> TicketMetrics {
        let c = |n: &str| IntCounter::new(n, "t").unwrap();
        TicketMetrics {
            issued: c("i"),
            resumed: c("r"),
            rejected: c("x"),
        }
    }

    #[test]
    fn a_ticket_naming_the_last_period_is_refused_without_overflow() {
        let a =
            RotatingTicketer::new(Some(vec![7; 32]), Duration::from_secs(3600), metrics()).unwrap();
        // The period is the client's first eight bytes: u64::MAX + 1 used
        // to overflow (a panic in a debug build).
        let mut t = u64::MAX.to_be_bytes().to_vec();
        t.extend_from_slice(&[0; 64]);
        assert!(a.decrypt(&t).is_none());
    }

    #[test]
    fn tickets_live_two_periods_and_shared_secrets_interoperate() {
        let hour = Duration::from_secs(3600);
        let a = RotatingTicketer::new(Some(vec![7; 32]), hour, metrics()).unwrap();
        let t = a.encrypt(b"session state").unwrap();
        assert_eq!(a.decrypt(&t).unwrap(), b"session state");
        let b = RotatingTicketer::new(Some(vec![7; 32]), hour, metrics()).unwrap();
        assert_eq!(
            b.decrypt(&t).unwrap(),
            b"session state",
            "same secret, other instance"
        );
        let later = RotatingTicketer::new(Some(vec![7; 32]), hour, metrics())
            .unwrap()
            .with_skew(hour);
        assert!(
            later.decrypt(&t).is_some(),
            "previous key still accepted for one period"
        );
        let much_later = RotatingTicketer::new(Some(vec![7; 32]), hour, metrics())
            .unwrap()
            .with_skew(hour * 2);
        assert!(
            much_later.decrypt(&t).is_none(),
            "retired after two rotations"
        );
        let other = RotatingTicketer::new(None, hour, metrics()).unwrap();
        assert!(other.decrypt(&t).is_none());
        let mut bad = t.clone();
        let last = bad.len() - 1;
        bad[last] ^= 1;
        assert!(a.decrypt(&bad).is_none());
        assert!(a.decrypt(&[1, 2, 3]).is_none());
    }
}
