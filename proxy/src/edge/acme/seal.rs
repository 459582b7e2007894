//! What an instance shares through the cluster's store, sealed: the issued
//! chain and its private key go to Redis encrypted and authenticated
//! (ChaCha20-Poly1305 under `acme.shared_key_file`, the value's name as
//! associated data), so a reader of the store learns nothing and a writer
//! cannot have a certificate of its own installed (nor move one sealed
//! for other names onto these). What it opens is installed only if its
//! chain verifies up to the issuer's roots for every configured name
//! (`chains_to`): a key that leaked still cannot place a certificate the
//! directory did not issue.

use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, CHACHA20_POLY1305, NONCE_LEN};
use ring::rand::{SecureRandom, SystemRandom};

fn key(secret: &[u8; 32]) -> Option<LessSafeKey> {
    UnboundKey::new(&CHACHA20_POLY1305, secret)
        .ok()
        .map(LessSafeKey::new)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// `plain` sealed for the store under `name`: hex of nonce and ciphertext.
pub fn seal(secret: &[u8; 32], name: &str, plain: &str) -> Option<String> {
    let k = key(secret)?;
    let mut nonce = [0u8; NONCE_LEN];
    SystemRandom::new().fill(&mut nonce).ok()?;
    let mut out = plain.as_bytes().to_vec();
    k.seal_in_place_append_tag(
        Nonce::assume_unique_for_key(nonce),
        Aad::from(name.as_bytes()),
        &mut out,
    )
    .ok()?;
    Some(format!("{}{}", hex(&nonce), hex(&out)))
}

/// What `seal` made for `name`, if this secret made it and nobody changed it.
pub fn open(secret: &[u8; 32], name: &str, sealed: &str) -> Option<String> {
    let k = key(secret)?;
    let raw = unhex(sealed.trim())?;
    if raw.len() < NONCE_LEN {
        return None;
    }
    let (n, body) = raw.split_at(NONCE_LEN);
    let nonce = Nonce::try_assume_unique_for_key(n).ok()?;
    let mut body = body.to_vec();
    let plain = k
        .open_in_place(nonce, Aad::from(name.as_bytes()), &mut body)
        .ok()?;
    String::from_utf8(plain.to_vec()).ok()
}

/// Whether the PEM chain's leaf verifies, through the chain's own
/// intermediates, up to `roots` (DER; empty: the web's roots) for every
/// name of `domains`, now.
pub fn chains_to(pem: &str, roots: &[Vec<u8>], domains: &[String]) -> Result<(), String> {
    use rustls::client::danger::ServerCertVerifier;
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
    let certs = CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("not a PEM chain: {e}"))?;
    let (leaf, intermediates) = certs.split_first().ok_or("no certificate")?;
    let mut store = rustls::RootCertStore::empty();
    if roots.is_empty() {
        store.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    } else {
        for r in roots {
            store
                .add(CertificateDer::from(r.clone()))
                .map_err(|e| format!("issuer root: {e}"))?;
        }
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
        std::sync::Arc::new(store),
        provider,
    )
    .build()
    .map_err(|e| e.to_string())?;
    for d in domains {
        let name = ServerName::try_from(d.clone()).map_err(|e| format!("{d}: {e}"))?;
        verifier
            .verify_server_cert(leaf, intermediates, &name, &[], UnixTime::now())
            .map_err(|e| format!("{d}: {e}"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_same_secret_and_name_open_what_was_sealed() {
        let k = [7u8; 32];
        let sealed = seal(&k, "acme:cert:a.example", "PEM").unwrap_or_default();
        assert!(!sealed.contains("PEM"));
        assert_eq!(
            open(&k, "acme:cert:a.example", &sealed).as_deref(),
            Some("PEM")
        );
        assert_eq!(open(&[8u8; 32], "acme:cert:a.example", &sealed), None);
        assert_eq!(open(&k, "acme:cert:b.example", &sealed), None);
        // A clear PEM a store writer put there is not opened.
        assert_eq!(
            open(&k, "acme:cert:a.example", "-----BEGIN CERTIFICATE-----"),
            None
        );
        let mut flipped = sealed.clone().into_bytes();
        let last = flipped.len() - 1;
        flipped[last] = if flipped[last] == b'0' { b'1' } else { b'0' };
        assert_eq!(
            open(
                &k,
                "acme:cert:a.example",
                &String::from_utf8(flipped).unwrap_or_default()
            ),
            None
        );
    }

    #[test]
    fn a_chain_is_taken_only_up_to_the_issuers_roots_and_for_its_names() {
        use rustls::pki_types::pem::PemObject;
        let der = |pem: &str| {
            rustls::pki_types::CertificateDer::pem_slice_iter(pem.as_bytes())
                .filter_map(Result::ok)
                .map(|c| c.as_ref().to_vec())
                .collect::<Vec<_>>()
        };
        let issued =
            crate::edge::devcerts::generate(&["a.example.com"]).unwrap_or_else(|e| panic!("{e}"));
        let pem = format!("{}{}", issued.chain_pem, issued.key_pem);
        let roots = der(&issued.ca_pem);
        let names = |n: &str| vec![n.to_string()];
        assert_eq!(chains_to(&pem, &roots, &names("a.example.com")), Ok(()));
        assert!(chains_to(&pem, &roots, &names("b.example.com")).is_err());
        // Another CA's certificate for the same name: not the issuer's.
        let other =
            crate::edge::devcerts::generate(&["a.example.com"]).unwrap_or_else(|e| panic!("{e}"));
        assert!(chains_to(&other.chain_pem, &roots, &names("a.example.com")).is_err());
        // The web's roots do not know a private CA.
        assert!(chains_to(&pem, &[], &names("a.example.com")).is_err());
    }
}
