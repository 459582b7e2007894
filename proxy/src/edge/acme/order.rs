//! One ACME order, start to end: the account (stored, or made and stored),
//! a new order for the listener's names, each authorization answered with
//! the configured challenge, a fresh key and its CSR, the chain.

use super::challenge::{alpn_cert, Installed};
use super::client::Client;
use super::state::{self, Stored};
use crate::config::{AcmeChallenge, AcmeSpec};
use instant_acme::{
    Account, AuthorizationStatus, CertificateIdentifier, ChallengeType, Identifier, NewAccount,
    NewOrder, OrderStatus, RetryPolicy,
};

/// How long validation and issuance may take before the order is given up.
const POLL: RetryPolicy = RetryPolicy::new()
    .initial_delay(std::time::Duration::from_millis(250))
    .backoff(1.5)
    .timeout(std::time::Duration::from_secs(90));

/// An issued certificate: the chain and its private key, PEM.
pub struct Chain {
    /// Leaf first.
    pub chain: String,
    /// PKCS#8.
    pub key: String,
}

fn problem(e: instant_acme::Error) -> String {
    match e {
        instant_acme::Error::Api(p) => {
            let kind = p.r#type.unwrap_or_default();
            let kind = kind.rsplit(':').next().unwrap_or_default().to_string();
            let mut msg = format!("{kind}: {}", p.detail.unwrap_or_default());
            for s in p.subproblems {
                msg.push_str(&format!("; {}", s.detail.unwrap_or_default()));
            }
            msg
        }
        other => other.to_string(),
    }
}

/// The account of `spec`: the stored one, or a new one (stored at once).
pub async fn account(spec: &AcmeSpec) -> Result<Account, String> {
    let builder = || Account::builder_with_http(Box::new(Client::new(&spec.trust_roots)));
    if let Some(creds) = state::load_account(&spec.state_dir, &spec.directory) {
        return builder().from_credentials(creds).await.map_err(problem);
    }
    let contact: Vec<&str> = spec.contact.iter().map(String::as_str).collect();
    let new = NewAccount {
        contact: &contact,
        terms_of_service_agreed: true,
        only_return_existing: false,
    };
    let (account, credentials) = builder()
        .create(&new, spec.directory.clone(), None)
        .await
        .map_err(problem)?;
    state::save_account(
        &spec.state_dir,
        &Stored {
            directory: spec.directory.clone(),
            credentials,
        },
    )?;
    log::info!(
        "ACME account {} created on {}",
        account.id(),
        spec.directory
    );
    Ok(account)
}

/// Whether an error says the directory does not know the account (it was
/// deactivated, or the directory's state was reset): a new one is made.
pub fn unknown_account(e: &str) -> bool {
    e.starts_with("accountDoesNotExist") || e.starts_with("unauthorized: No existing account")
}

/// Order a certificate for `spec.domains` on `account`; `replaces` names
/// the certificate it succeeds (ARI), where the directory supports it.
pub async fn order(
    spec: &AcmeSpec,
    account: &Account,
    replaces: Option<CertificateIdentifier<'static>>,
) -> Result<Chain, String> {
    let ids: Vec<Identifier> = spec
        .domains
        .iter()
        .map(|d| Identifier::Dns(d.clone()))
        .collect();
    let mut new = NewOrder::new(&ids);
    if let Some(r) = replaces {
        new = new.replaces(r);
    }
    let mut order = account.new_order(&new).await.map_err(problem)?;
    let mut installed = Installed::default();
    let kind = match spec.challenge {
        AcmeChallenge::Http01 => ChallengeType::Http01,
        AcmeChallenge::TlsAlpn01 => ChallengeType::TlsAlpn01,
    };
    let mut authorizations = order.authorizations();
    while let Some(a) = authorizations.next().await {
        let mut a = a.map_err(problem)?;
        match a.status {
            AuthorizationStatus::Valid => continue,
            AuthorizationStatus::Pending => {}
            other => return Err(format!("authorization {other:?}")),
        }
        let mut ch = a
            .challenge(kind.clone())
            .ok_or_else(|| format!("the directory offers no {kind:?} challenge"))?;
        let ka = ch.key_authorization();
        match spec.challenge {
            AcmeChallenge::Http01 => installed.http(&ch.token, ka.as_str()).await,
            AcmeChallenge::TlsAlpn01 => {
                let name = match ch.identifier().identifier {
                    Identifier::Dns(d) => d.clone(),
                    other => return Err(format!("cannot answer for {other:?}")),
                };
                installed.alpn(&name, alpn_cert(&name, ka.digest().as_ref())?);
            }
        }
        ch.set_ready().await.map_err(problem)?;
    }
    let status = order.poll_ready(&POLL).await.map_err(problem)?;
    if status != OrderStatus::Ready {
        let why = order
            .state()
            .error
            .as_ref()
            .and_then(|p| p.detail.clone())
            .unwrap_or_default();
        installed.clear().await;
        return Err(format!("order {status:?}: {why}"));
    }
    installed.clear().await;
    let key = rcgen::KeyPair::generate().map_err(|e| e.to_string())?;
    let csr = rcgen::CertificateParams::new(spec.domains.clone())
        .and_then(|p| p.serialize_request(&key))
        .map_err(|e| e.to_string())?;
    order.finalize_csr(csr.der()).await.map_err(problem)?;
    let chain = order.poll_certificate(&POLL).await.map_err(problem)?;
    Ok(Chain {
        chain,
        key: key.serialize_pem(),
    })
}
