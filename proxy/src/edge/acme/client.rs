//! The HTTP client of ACME requests: ureq (blocking, on Tokio's blocking
//! pool), trusting the web roots or the directory's own CA.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use instant_acme::{BodyWrapper, BytesResponse, Error, HttpClient};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

/// Most bytes of one directory response (a certificate chain is a few KiB).
const MAX_RESPONSE: u64 = 1 << 20;
/// Most time for one request, connection included.
const TIMEOUT: Duration = Duration::from_secs(30);

/// ACME requests over ureq.
pub struct Client {
    agent: ureq::Agent,
}

impl Client {
    /// A client trusting `roots` (DER certificates), or the web roots
    /// where there are none.
    pub fn new(roots: &[Vec<u8>]) -> Self {
        use ureq::tls::{Certificate, RootCerts, TlsConfig};
        let mut tls = TlsConfig::builder();
        if !roots.is_empty() {
            let certs = roots
                .iter()
                .map(|d| Certificate::from_der(d).to_owned())
                .collect();
            tls = tls.root_certs(RootCerts::Specific(Arc::new(certs)));
        }
        let config = ureq::Agent::config_builder()
            .tls_config(tls.build())
            // Problem documents come with 4xx statuses: the ACME client
            // reads them.
            .http_status_as_error(false)
            .timeout_global(Some(TIMEOUT))
            .build();
        Client {
            agent: config.into(),
        }
    }
}

fn other(e: impl std::error::Error + Send + Sync + 'static) -> Error {
    Error::Other(Box::new(e))
}

impl HttpClient for Client {
    fn request(
        &self,
        req: http::Request<BodyWrapper<Bytes>>,
    ) -> Pin<Box<dyn Future<Output = Result<BytesResponse, Error>> + Send>> {
        let agent = self.agent.clone();
        Box::pin(async move {
            let (parts, body) = req.into_parts();
            let body = match body.collect().await {
                Ok(b) => b.to_bytes(),
                Err(never) => match never {},
            };
            let req = http::Request::from_parts(parts, body.to_vec());
            let sent = tokio::task::spawn_blocking(move || {
                let rsp = agent.run(req)?;
                let (parts, body) = rsp.into_parts();
                let bytes = body.into_with_config().limit(MAX_RESPONSE).read_to_vec()?;
                Ok::<_, ureq::Error>(http::Response::from_parts(
                    parts,
                    Full::new(Bytes::from(bytes)),
                ))
            })
            .await;
            match sent {
                Ok(Ok(rsp)) => Ok(BytesResponse::from(rsp)),
                Ok(Err(e)) => Err(other(e)),
                Err(e) => Err(other(e)),
            }
        })
    }
}
