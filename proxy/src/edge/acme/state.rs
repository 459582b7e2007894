//! What an ACME listener keeps in its `state_dir`: the account
//! (`account.json`: the directory it belongs to and its credentials) and
//! the certificate (`certificate.pem`: the chain, then its key). Both are
//! written to a temporary file and renamed, so a reader (a restart, the
//! certificate watcher, another instance on a shared disk) sees the old
//! file or the new one, never half of one.

use instant_acme::AccountCredentials;
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::Path;
use std::time::{Duration, SystemTime};

/// The account file's contents.
#[derive(Serialize, Deserialize)]
pub struct Stored {
    /// The directory the account was made on.
    pub directory: String,
    /// Its key and URL.
    pub credentials: AccountCredentials,
}

/// Create the state directory, readable by this user only.
pub fn ensure_dir(dir: &Path) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    Ok(())
}

/// Write `bytes` to `path` through a temporary file and a rename (mode
/// 0600: it holds a private key).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), String> {
    let tmp = path.with_extension("tmp");
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    let write = || -> std::io::Result<()> {
        let mut f = opts.open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    };
    write().map_err(|e| format!("{}: {e}", path.display()))
}

/// The stored account, if it belongs to `directory`.
pub fn load_account(dir: &Path, directory: &str) -> Option<AccountCredentials> {
    let text = std::fs::read(dir.join("account.json")).ok()?;
    let stored: Stored = serde_json::from_slice(&text).ok()?;
    (stored.directory == directory).then_some(stored.credentials)
}

/// Keep the account for the next start.
pub fn save_account(dir: &Path, stored: &Stored) -> Result<(), String> {
    let bytes = serde_json::to_vec(stored).map_err(|e| e.to_string())?;
    write_atomic(&dir.join("account.json"), &bytes)
}

/// Forget an account the directory no longer knows.
pub fn drop_account(dir: &Path) {
    let _ = std::fs::remove_file(dir.join("account.json"));
}

/// What the served certificate says of itself.
#[derive(Debug, Clone, PartialEq)]
pub struct Issued {
    /// Start of validity.
    pub not_before: SystemTime,
    /// End of validity.
    pub not_after: SystemTime,
    /// Its DNS names (lowercase).
    pub names: Vec<String>,
    /// The leaf, DER.
    pub leaf: Vec<u8>,
    /// The issuer's distinguished name, as text.
    pub issuer: String,
}

impl Issued {
    /// Read the leaf of a PEM chain.
    pub fn from_pem(pem: &[u8]) -> Option<Issued> {
        use rustls::pki_types::pem::PemObject;
        let leaf = rustls::pki_types::CertificateDer::pem_slice_iter(pem)
            .next()?
            .ok()?;
        let (_, cert) = x509_parser::parse_x509_certificate(leaf.as_ref()).ok()?;
        let at = |t: i64| SystemTime::UNIX_EPOCH + Duration::from_secs(t.max(0) as u64);
        let v = cert.validity();
        let mut names = Vec::new();
        if let Ok(Some(san)) = cert.subject_alternative_name() {
            for n in &san.value.general_names {
                if let x509_parser::extensions::GeneralName::DNSName(d) = n {
                    names.push(d.to_ascii_lowercase());
                }
            }
        }
        Some(Issued {
            not_before: at(v.not_before.timestamp()),
            not_after: at(v.not_after.timestamp()),
            names,
            issuer: cert.issuer().to_string(),
            leaf: leaf.as_ref().to_vec(),
        })
    }

    /// Read the certificate file, if there is one.
    pub fn read(path: &Path) -> Option<Issued> {
        Issued::from_pem(&std::fs::read(path).ok()?)
    }

    /// Its ACME identifier (RFC 9773: authority key id and serial), for
    /// Renewal Information and an order's `replaces`.
    pub fn cert_id(&self) -> Option<instant_acme::CertificateIdentifier<'static>> {
        let der = rustls::pki_types::CertificateDer::from(self.leaf.as_slice());
        instant_acme::CertificateIdentifier::try_from(&der)
            .ok()
            .map(|i| i.into_owned())
    }

    /// Whether it serves every one of `domains`.
    pub fn covers(&self, domains: &[String]) -> bool {
        domains.iter().all(|d| self.names.contains(d))
    }

    /// When it is due for renewal without advice from the directory: at
    /// two thirds of its lifetime (as Let's Encrypt and certbot advise).
    pub fn two_thirds(&self) -> SystemTime {
        let life = self
            .not_after
            .duration_since(self.not_before)
            .unwrap_or_default();
        self.not_before + life * 2 / 3
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn self_signed(names: &[&str], days: u64) -> String {
        let mut p =
            rcgen::CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .unwrap();
        let now = rcgen::date_time_ymd(2026, 1, 1);
        p.not_before = now;
        p.not_after = now + Duration::from_secs(days * 86_400);
        let key = rcgen::KeyPair::generate().unwrap();
        p.self_signed(&key).unwrap().pem()
    }

    #[test]
    fn reads_names_lifetime_and_renewal_point() {
        let pem = self_signed(&["a.example.com", "B.example.com"], 90);
        let i = Issued::from_pem(pem.as_bytes()).unwrap();
        assert_eq!(i.names, vec!["a.example.com", "b.example.com"]);
        let life = i.not_after.duration_since(i.not_before).unwrap();
        assert_eq!(life, Duration::from_secs(90 * 86_400));
        assert_eq!(
            i.two_thirds().duration_since(i.not_before).unwrap(),
            Duration::from_secs(60 * 86_400)
        );
        assert!(i.covers(&["a.example.com".into()]));
        assert!(!i.covers(&["c.example.com".into()]));
        assert!(Issued::from_pem(b"not pem").is_none());
    }

    #[test]
    fn writes_replace_whole_files_readable_by_the_owner_only() {
        let dir = std::env::temp_dir().join(format!("uf-acme-state-{}", std::process::id()));
        ensure_dir(&dir).unwrap();
        let path = dir.join("certificate.pem");
        write_atomic(&path, b"one").unwrap();
        write_atomic(&path, b"two").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
            let mode = std::fs::metadata(&dir).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o700);
        }
        assert!(!dir.join("certificate.tmp").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
