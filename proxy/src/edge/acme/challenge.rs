//! The answers to the directory's validators while an order is open:
//! HTTP-01 key authorizations by token (served by the plain listeners,
//! and through the cluster's store by every instance), and TLS-ALPN-01
//! certificates by name (served by the TLS listener's resolver to a
//! handshake offering `acme-tls/1` alone).

use parking_lot::Mutex;
use rustls::sign::CertifiedKey;
use std::collections::HashMap;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

/// The ALPN protocol of TLS-ALPN-01 (RFC 8737 6.2).
pub const ACME_TLS_ALPN: &[u8] = b"acme-tls/1";

/// Where HTTP-01 tokens are asked for (RFC 8555 8.3).
pub const HTTP01_PREFIX: &str = "/.well-known/acme-challenge/";

/// How long a token is kept in the cluster's store (an order's life).
const SHARED_TTL: Duration = Duration::from_secs(600);

static HTTP: LazyLock<Mutex<HashMap<String, String>>> = LazyLock::new(Default::default);
static ALPN: LazyLock<Mutex<HashMap<String, Arc<CertifiedKey>>>> = LazyLock::new(Default::default);

/// A token as a directory makes them: base64url, at most 128 characters.
/// Anything else is never looked up (nor sent to the store).
pub fn valid_token(t: &str) -> bool {
    (1..=128).contains(&t.len())
        && t.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

fn shared_name(token: &str) -> String {
    format!("acme:http01:{token}")
}

/// The key authorization of an HTTP-01 token of this instance's orders or,
/// with `[cluster]`, of another instance's.
pub async fn http_answer(token: &str) -> Option<String> {
    if !valid_token(token) {
        return None;
    }
    if let Some(ka) = HTTP.lock().get(token).cloned() {
        return Some(ka);
    }
    let c = crate::cluster::get()?;
    c.fetch(&shared_name(token)).await.ok().flatten()
}

/// Whether a ClientHello is a TLS-ALPN-01 validation: `acme-tls/1` is the
/// only protocol it offers.
pub fn is_challenge_hello<'a>(alpn: Option<impl Iterator<Item = &'a [u8]>>) -> bool {
    let Some(mut protocols) = alpn else {
        return false;
    };
    protocols.next() == Some(ACME_TLS_ALPN) && protocols.next().is_none()
}

/// The TLS-ALPN-01 certificate for `name`, while its order is open.
pub fn alpn_certificate(name: &str) -> Option<Arc<CertifiedKey>> {
    ALPN.lock().get(&name.to_ascii_lowercase()).cloned()
}

/// The certificate a TLS-ALPN-01 validator must see for `name`: self-signed,
/// for `name` alone, with the critical `acmeIdentifier` extension holding
/// the SHA-256 of the key authorization (RFC 8737 3).
pub fn alpn_cert(name: &str, digest: &[u8]) -> Result<Arc<CertifiedKey>, String> {
    let mut params =
        rcgen::CertificateParams::new(vec![name.to_string()]).map_err(|e| e.to_string())?;
    params.custom_extensions = vec![rcgen::CustomExtension::new_acme_identifier(digest)];
    let key = rcgen::KeyPair::generate().map_err(|e| e.to_string())?;
    let cert = params.self_signed(&key).map_err(|e| e.to_string())?;
    let der = rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into());
    let signer = rustls::crypto::ring::sign::any_supported_type(&der).map_err(|e| e.to_string())?;
    Ok(Arc::new(CertifiedKey::new(
        vec![cert.der().clone()],
        signer,
    )))
}

/// The answers one order installed; dropping it removes them, so an order
/// that fails or is abandoned leaves none behind.
#[derive(Default)]
pub struct Installed {
    tokens: Vec<String>,
    names: Vec<String>,
}

impl Installed {
    /// Answer HTTP-01 `token` with `key_auth` (here, and in the cluster's
    /// store when there is one).
    pub async fn http(&mut self, token: &str, key_auth: &str) {
        HTTP.lock().insert(token.to_string(), key_auth.to_string());
        self.tokens.push(token.to_string());
        if let Some(c) = crate::cluster::get() {
            let _ = c
                .put(&shared_name(token), key_auth.to_string(), SHARED_TTL)
                .await;
        }
    }

    /// Answer TLS-ALPN-01 for `name` with `cert`.
    pub fn alpn(&mut self, name: &str, cert: Arc<CertifiedKey>) {
        let name = name.to_ascii_lowercase();
        ALPN.lock().insert(name.clone(), cert);
        self.names.push(name);
    }

    /// Remove the answers now, from the store too.
    pub async fn clear(&mut self) {
        if let Some(c) = crate::cluster::get() {
            for t in &self.tokens {
                let _ = c.remove(&shared_name(t)).await;
            }
        }
        self.forget();
    }

    /// Remove the answers from this instance's tables.
    fn forget(&mut self) {
        let mut http = HTTP.lock();
        for t in self.tokens.drain(..) {
            http.remove(&t);
        }
        drop(http);
        let mut alpn = ALPN.lock();
        for n in self.names.drain(..) {
            alpn.remove(&n);
        }
    }
}

impl Drop for Installed {
    fn drop(&mut self) {
        // An order that failed or was dropped mid-way: the store's copies
        // lapse with their TTL.
        self.forget();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_hello_offering_acme_tls_alone_is_a_validation() {
        let one: Vec<&[u8]> = vec![ACME_TLS_ALPN];
        assert!(is_challenge_hello(Some(one.into_iter())));
        let mixed: Vec<&[u8]> = vec![b"h2", ACME_TLS_ALPN];
        assert!(!is_challenge_hello(Some(mixed.into_iter())));
        let after: Vec<&[u8]> = vec![ACME_TLS_ALPN, b"http/1.1"];
        assert!(!is_challenge_hello(Some(after.into_iter())));
        assert!(!is_challenge_hello(None::<std::vec::IntoIter<&[u8]>>));
    }

    #[test]
    fn tokens_outside_base64url_are_never_looked_up() {
        assert!(valid_token("abc-DEF_123"));
        assert!(!valid_token(""));
        assert!(!valid_token("../etc/passwd"));
        assert!(!valid_token("a b"));
        assert!(!valid_token(&"a".repeat(129)));
    }

    #[tokio::test]
    async fn answers_live_as_long_as_their_order() {
        let cert = alpn_cert("t.example.com", &[7u8; 32]).unwrap();
        {
            let mut i = Installed::default();
            i.http("tok-1", "tok-1.thumb").await;
            i.alpn("T.example.com", cert.clone());
            assert_eq!(http_answer("tok-1").await.as_deref(), Some("tok-1.thumb"));
            assert!(alpn_certificate("t.example.com").is_some());
        }
        assert_eq!(http_answer("tok-1").await, None);
        assert!(alpn_certificate("t.example.com").is_none());
        // The certificate names the domain and carries the identifier.
        let (_, x) = x509_parser::parse_x509_certificate(cert.cert[0].as_ref()).unwrap();
        let ext = x
            .extensions()
            .iter()
            .find(|e| e.oid.to_id_string() == "1.3.6.1.5.5.7.1.31")
            .unwrap();
        assert!(ext.critical);
        assert!(ext.value.ends_with(&[7u8; 32]));
    }
}
