//! Who an inference request is served for, for fair shares inside a lane:
//! the API key's name (with the key's `weight`) when keys are configured,
//! else what `[inference] tenant` names: the client address, the body's
//! end-user field (OpenAI `user`, Anthropic `metadata.user_id`) or a
//! header. Values a client chooses are bounded in length and prefixed by
//! their source, so no client can pose as a key's tenant.

use super::context::Incoming;
use ultrafast_engine::fair::Tenant;

/// Longest client-chosen tenant value kept (bytes; longer ones are cut).
const MAX_VALUE: usize = 128;

/// Where a request without a key finds its tenant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TenantSource {
    /// The client address.
    ClientIp,
    /// The body's end-user field.
    User,
    /// A request header.
    Header(http::HeaderName),
}

impl TenantSource {
    /// `client_ip`, `user` or `header:NAME`.
    pub fn parse(s: &str) -> Option<TenantSource> {
        match s {
            "client_ip" => Some(TenantSource::ClientIp),
            "user" => Some(TenantSource::User),
            _ => {
                let name = s.strip_prefix("header:")?;
                http::HeaderName::from_bytes(name.as_bytes())
                    .ok()
                    .map(TenantSource::Header)
            }
        }
    }
}

fn cut(v: &str) -> &str {
    let mut end = v.len().min(MAX_VALUE);
    while !v.is_char_boundary(end) {
        end -= 1;
    }
    &v[..end]
}

/// The tenant of `inc`, whose body named `user` as its end user.
pub fn tenant_of(inc: &Incoming, user: Option<&str>) -> Tenant {
    if let Some(k) = &inc.key {
        return k.tenant.clone();
    }
    let value = match &inc.cfg.tenant_source() {
        TenantSource::User => user.map(|u| format!("user:{}", cut(u))),
        TenantSource::Header(h) => inc
            .headers
            .get(h)
            .and_then(|v| v.to_str().ok())
            .map(|v| format!("header:{}", cut(v))),
        TenantSource::ClientIp => None,
    };
    // The client address when the chosen source is absent from the request.
    let value = value.unwrap_or_else(|| match inc.client_ip {
        Some(ip) => format!("ip:{ip}"),
        None => "ip:unknown".into(),
    });
    Tenant::named(&value, 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_parse_and_values_are_bounded() {
        assert_eq!(
            TenantSource::parse("client_ip"),
            Some(TenantSource::ClientIp)
        );
        assert_eq!(TenantSource::parse("user"), Some(TenantSource::User));
        assert!(matches!(
            TenantSource::parse("header:x-tenant"),
            Some(TenantSource::Header(_))
        ));
        assert_eq!(TenantSource::parse("header:bad name"), None);
        assert_eq!(TenantSource::parse("cookie"), None);
        let long = "é".repeat(200);
        assert!(cut(&long).len() <= MAX_VALUE);
        assert!(cut(&long).chars().all(|c| c == 'é'));
    }
}
