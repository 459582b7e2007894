//! `ultrafast certs dev`: a throwaway local CA and a certificate for
//! `localhost`, `127.0.0.1` and `::1`, for development and tests. Generated
//! on demand (rcgen, ECDSA P-256); nothing here is ever committed.

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
use std::path::{Path, PathBuf};

/// PEM texts of a dev CA and a leaf it signed.
pub struct DevCerts {
    /// The CA certificate (trust this in clients).
    pub ca_pem: String,
    /// The leaf certificate followed by the CA (a full chain).
    pub chain_pem: String,
    /// The leaf's private key.
    pub key_pem: String,
}

fn err(e: rcgen::Error) -> String {
    format!("certificate generation failed: {e}")
}

/// A CA and a leaf for `names` (DNS names or IP addresses).
pub fn generate(names: &[&str]) -> Result<DevCerts, String> {
    let mut ca = CertificateParams::new(Vec::<String>::new()).map_err(err)?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, "ultrafast development CA");
    let ca_key = KeyPair::generate().map_err(err)?;
    let issuer = CertifiedIssuer::self_signed(ca, ca_key).map_err(err)?;
    let sans: Vec<String> = names.iter().map(|s| s.to_string()).collect();
    let mut leaf = CertificateParams::new(sans).map_err(err)?;
    leaf.distinguished_name.push(
        DnType::CommonName,
        names.first().copied().unwrap_or("localhost"),
    );
    let leaf_key = KeyPair::generate().map_err(err)?;
    let cert = leaf.signed_by(&leaf_key, &issuer).map_err(err)?;
    let ca_pem = issuer.pem();
    Ok(DevCerts {
        chain_pem: format!("{}{}", cert.pem(), ca_pem),
        ca_pem,
        key_pem: leaf_key.serialize_pem(),
    })
}

fn write_private(path: &Path, text: &str) -> Result<(), String> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    f.write_all(text.as_bytes())
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// Write `ca.pem`, `localhost.pem` (chain) and `localhost.key` (0600) into `dir`.
pub fn write(dir: &Path) -> Result<Vec<PathBuf>, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let c = generate(&["localhost", "127.0.0.1", "::1"])?;
    let (ca, chain, key) = (
        dir.join("ca.pem"),
        dir.join("localhost.pem"),
        dir.join("localhost.key"),
    );
    std::fs::write(&ca, &c.ca_pem).map_err(|e| format!("{}: {e}", ca.display()))?;
    std::fs::write(&chain, &c.chain_pem).map_err(|e| format!("{}: {e}", chain.display()))?;
    write_private(&key, &c.key_pem)?;
    Ok(vec![ca, chain, key])
}
