//! `tls.acme` of a listener, checked: what `ultrafast check` refuses before
//! any order is placed (a directory that is not HTTPS, a name a CA cannot
//! validate over HTTP or TLS, trust roots that are not certificates).

use super::file::AcmeSection;
use super::locate::FieldPath;
use super::validate::{valid_host, Errors};
use super::{AcmeChallenge, AcmeSpec};
use std::path::PathBuf;

/// Most names on one certificate (Let's Encrypt's limit).
const MAX_DOMAINS: usize = 100;

/// The listener's ACME settings, or `None` with every problem pushed.
pub fn acme(a: &AcmeSection, at: &FieldPath, errs: &mut Errors) -> Option<AcmeSpec> {
    let before = errs.0.len();
    if !a.directory.starts_with("https://") || a.directory.len() <= "https://".len() {
        errs.push(
            at.k("directory"),
            format!(
                "`{}` is not an https:// directory URL (RFC 8555 requires HTTPS)",
                a.directory
            ),
        );
    }
    if a.domains.is_empty() {
        errs.push(at.k("domains"), "at least one domain is required");
    }
    if a.domains.len() > MAX_DOMAINS {
        errs.push(
            at.k("domains"),
            format!("at most {MAX_DOMAINS} names fit one certificate"),
        );
    }
    let mut domains = Vec::new();
    for (i, d) in a.domains.iter().enumerate() {
        let d = d.to_ascii_lowercase();
        if d.starts_with("*.") {
            errs.push(
                at.k("domains").i(i),
                format!("`{d}`: a wildcard needs the dns-01 challenge, which is not supported"),
            );
        } else if !valid_host(&d) || !d.contains('.') || d.starts_with('.') || d.ends_with('.') {
            errs.push(
                at.k("domains").i(i),
                format!("`{d}` is not a fully qualified host name"),
            );
        } else if domains.contains(&d) {
            errs.push(at.k("domains").i(i), format!("`{d}` is listed twice"));
        } else {
            domains.push(d);
        }
    }
    for (i, c) in a.contact.iter().enumerate() {
        if !c.starts_with("mailto:") || !c.contains('@') {
            errs.push(
                at.k("contact").i(i),
                format!("`{c}` is not a mailto: address"),
            );
        }
    }
    let challenge = match a.challenge.as_str() {
        "http-01" => AcmeChallenge::Http01,
        "tls-alpn-01" => AcmeChallenge::TlsAlpn01,
        other => {
            errs.push(
                at.k("challenge"),
                format!("`{other}` is not one of http-01, tls-alpn-01"),
            );
            AcmeChallenge::Http01
        }
    };
    let trust_roots = roots(&a.trust_roots, "trust_roots", at, errs);
    if a.state_dir.trim().is_empty() {
        errs.push(
            at.k("state_dir"),
            "a directory for the account key and the certificate is required",
        );
    }
    let issuer_roots = roots(&a.issuer_roots, "issuer_roots", at, errs);
    let shared_key = if a.shared_key_file.is_empty() {
        None
    } else {
        match super::validate::read_ticket_key_file(std::path::Path::new(&a.shared_key_file)) {
            Ok(k) => {
                let mut key = [0u8; 32];
                key.copy_from_slice(&k[..32]);
                Some(key)
            }
            Err(e) => {
                errs.push(at.k("shared_key_file"), e);
                None
            }
        }
    };
    (errs.0.len() == before).then(|| AcmeSpec {
        directory: a.directory.clone(),
        domains,
        contact: a.contact.clone(),
        challenge,
        trust_roots,
        state_dir: PathBuf::from(&a.state_dir),
        issuer_roots,
        shared_key,
    })
}

/// The roots of a PEM file named by field `key` (none when it is empty),
/// its problems reported at that field.
fn roots(path: &str, key: &str, at: &FieldPath, errs: &mut Errors) -> Vec<Vec<u8>> {
    if path.is_empty() {
        return Vec::new();
    }
    read_roots(path).unwrap_or_else(|e| {
        errs.push(at.k(key), e);
        Vec::new()
    })
}

/// The DER certificates of a PEM file (at least one).
fn read_roots(path: &str) -> Result<Vec<Vec<u8>>, String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::CertificateDer;
    let text = std::fs::read(path).map_err(|e| format!("{path}: {e}"))?;
    let certs = CertificateDer::pem_slice_iter(&text)
        .map(|c| c.map(|c| c.as_ref().to_vec()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{path}: not PEM certificates: {e}"))?;
    if certs.is_empty() {
        return Err(format!("{path}: no certificate found"));
    }
    Ok(certs)
}
