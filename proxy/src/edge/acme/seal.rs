//! What an instance shares through the cluster's store, sealed: the issued
//! chain and its private key go to Redis encrypted and authenticated
//! (ChaCha20-Poly1305 under `acme.shared_key_file`, the value's name as
//! associated data), so a reader of the store learns nothing and a writer
//! cannot have a certificate of its own installed (nor move one sealed
//! for other names onto these).

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
}
