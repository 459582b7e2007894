//! The PROXY protocol (HAProxy's spec, v1 text and v2 binary) on
//! listeners behind an L4 load balancer: the balancer opens each
//! connection with a header that carries the client's address, which then
//! becomes the connection's peer address everywhere (rate limits,
//! `X-Forwarded-For`, logs, traces, cluster limits), as nginx's `listen ...
//! proxy_protocol` with `set_real_ip_from` does.
//!
//! Only sources in `proxy_protocol_from` may send it; a connection from
//! elsewhere, or whose header is missing, malformed or late, is closed,
//! counted and logged. The header is read before a TLS handshake. Bytes
//! that arrive with it (a ClientHello, a request) are put back into the
//! stream. v2 TLVs are skipped (bounded: the whole header is at most
//! `MAX_V2`); `LOCAL` (v2) and `UNKNOWN` (v1), the balancer's own health
//! checks, keep the balancer's address.

use crate::config::spec::ProxyProtocol;
use pingora::protocols::l4::socket::SocketAddr as PeerAddr;
use pingora::protocols::l4::stream::Stream as L4Stream;
use pingora::protocols::GetSocketDigest;
use prometheus::IntCounterVec;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::io::AsyncReadExt;

/// The v2 signature.
const SIG: &[u8; 12] = b"\r\n\r\n\0\r\nQUIT\n";
/// The longest v1 line, CRLF included (the spec's bound).
const MAX_V1: usize = 107;
/// The longest v2 header accepted: 16 bytes plus addresses and TLVs. The
/// spec allows 65,535 bytes of those; balancers send tens to hundreds.
pub const MAX_V2: usize = 16 + 2048;

/// What a header says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Header {
    /// A proxied connection: the client's address and the one it reached.
    Proxied {
        /// The client.
        source: SocketAddr,
        /// The address the client connected to.
        destination: SocketAddr,
    },
    /// The balancer's own connection (v2 `LOCAL`, v1 `UNKNOWN`, or an
    /// address family other than TCP over IPv4/IPv6): no client address.
    Local,
}

/// Why a header was not accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bad {
    /// More bytes are needed.
    Incomplete,
    /// Not a valid header (what is wrong).
    Malformed(&'static str),
}

/// Parse a header at the start of `buf`: what it says and its length.
pub fn parse(buf: &[u8]) -> Result<(Header, usize), Bad> {
    let n = buf.len().min(SIG.len());
    if buf[..n] == SIG[..n] {
        return if buf.len() < 16 {
            Err(Bad::Incomplete)
        } else {
            v2(buf)
        };
    }
    let n = buf.len().min(6);
    if buf[..n] == b"PROXY "[..n] {
        return v1(buf);
    }
    Err(Bad::Malformed("no PROXY protocol header"))
}

fn v1(buf: &[u8]) -> Result<(Header, usize), Bad> {
    let window = &buf[..buf.len().min(MAX_V1)];
    let Some(end) = window.windows(2).position(|w| w == b"\r\n") else {
        return if buf.len() >= MAX_V1 {
            Err(Bad::Malformed("v1 line longer than 107 bytes"))
        } else {
            Err(Bad::Incomplete)
        };
    };
    let line =
        std::str::from_utf8(&buf[6..end]).map_err(|_| Bad::Malformed("v1 line is not text"))?;
    let mut f = line.split(' ');
    let proto = f.next().unwrap_or("");
    if proto == "UNKNOWN" {
        // The rest of the line is to be ignored.
        return Ok((Header::Local, end + 2));
    }
    let (src, dst, sport, dport) = match (f.next(), f.next(), f.next(), f.next(), f.next()) {
        (Some(a), Some(b), Some(c), Some(d), None) => (a, b, c, d),
        _ => return Err(Bad::Malformed("v1 line does not have 5 fields")),
    };
    let ip = |s: &str| -> Result<IpAddr, Bad> {
        match proto {
            "TCP4" => s.parse::<Ipv4Addr>().map(IpAddr::V4),
            "TCP6" => s.parse::<Ipv6Addr>().map(IpAddr::V6),
            _ => return Err(Bad::Malformed("v1 protocol is not TCP4, TCP6 or UNKNOWN")),
        }
        .map_err(|_| Bad::Malformed("v1 address does not match its protocol"))
    };
    // Ports are decimal without leading zeros, 0-65535.
    let port = |s: &str| -> Result<u16, Bad> {
        if s.is_empty()
            || (s.len() > 1 && s.starts_with('0'))
            || !s.bytes().all(|b| b.is_ascii_digit())
        {
            return Err(Bad::Malformed("v1 port is not a decimal number"));
        }
        s.parse()
            .map_err(|_| Bad::Malformed("v1 port is out of range"))
    };
    Ok((
        Header::Proxied {
            source: SocketAddr::new(ip(src)?, port(sport)?),
            destination: SocketAddr::new(ip(dst)?, port(dport)?),
        },
        end + 2,
    ))
}

fn v2(buf: &[u8]) -> Result<(Header, usize), Bad> {
    let (ver, cmd) = (buf[12] >> 4, buf[12] & 0x0f);
    if ver != 2 {
        return Err(Bad::Malformed("v2 version is not 2"));
    }
    let len = 16 + u16::from_be_bytes([buf[14], buf[15]]) as usize;
    if len > MAX_V2 {
        return Err(Bad::Malformed("v2 header longer than accepted"));
    }
    if buf.len() < len {
        return Err(Bad::Incomplete);
    }
    let body = &buf[16..len];
    match cmd {
        // LOCAL: the balancer's own connection; the addresses are ignored.
        0 => return Ok((Header::Local, len)),
        1 => {}
        _ => return Err(Bad::Malformed("v2 command is not LOCAL or PROXY")),
    }
    let (family, transport) = (buf[13] >> 4, buf[13] & 0x0f);
    // A transport other than STREAM, or a family other than IPv4/IPv6
    // (UNSPEC, unix sockets): accepted, but no client address to use.
    if transport != 1 || !matches!(family, 1 | 2) {
        return Ok((Header::Local, len));
    }
    let need = if family == 1 { 12 } else { 36 };
    if body.len() < need {
        return Err(Bad::Malformed("v2 address block shorter than its family"));
    }
    let at = |i: usize| u16::from_be_bytes([body[i], body[i + 1]]);
    let (source, destination) = if family == 1 {
        let ip = |i: usize| {
            IpAddr::V4(Ipv4Addr::new(
                body[i],
                body[i + 1],
                body[i + 2],
                body[i + 3],
            ))
        };
        (
            SocketAddr::new(ip(0), at(8)),
            SocketAddr::new(ip(4), at(10)),
        )
    } else {
        let ip = |i: usize| {
            let mut o = [0u8; 16];
            o.copy_from_slice(&body[i..i + 16]);
            IpAddr::V6(Ipv6Addr::from(o))
        };
        (
            SocketAddr::new(ip(0), at(32)),
            SocketAddr::new(ip(16), at(34)),
        )
    };
    // What follows the addresses are TLVs (ALPN, authority, CRC, SSL
    // details): skipped, as nginx does for those it does not expose.
    Ok((
        Header::Proxied {
            source,
            destination,
        },
        len,
    ))
}

/// Why a connection was closed before its first request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refused {
    Source,
    Malformed(&'static str),
    Missing,
    Timeout,
}

impl Refused {
    fn label(self) -> &'static str {
        match self {
            Refused::Source => "refused_source",
            Refused::Malformed(_) => "malformed",
            Refused::Missing => "missing",
            Refused::Timeout => "timeout",
        }
    }
}

/// A listener's PROXY protocol policy and its counter.
pub struct Policy {
    /// The sources allowed and the header's deadline.
    pub spec: ProxyProtocol,
    /// `ultrafast_proxy_protocol_total` by result.
    pub results: IntCounterVec,
}

/// When the last refusal was logged (unix seconds): at most one line a
/// second, so a flood of bad connections cannot flood the log.
static LAST_LOG: AtomicU64 = AtomicU64::new(0);

impl Policy {
    /// Read the header of a connection from `peer` and make its address
    /// the connection's peer address. False: the connection is to be
    /// closed (counted and logged).
    pub async fn accept(&self, l4: &mut L4Stream, peer: Option<SocketAddr>) -> bool {
        match self.read(l4, peer).await {
            Ok(header) => {
                let result = match header {
                    Header::Proxied { source, .. } => {
                        if let Some(d) = l4.get_socket_digest() {
                            // Set before anything reads it: from here on the
                            // connection's peer is the client.
                            let _ = d.peer_addr.set(Some(PeerAddr::Inet(source)));
                        }
                        "proxied"
                    }
                    Header::Local => "local",
                };
                self.results.with_label_values(&[result]).inc();
                true
            }
            Err(why) => {
                self.results.with_label_values(&[why.label()]).inc();
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs());
                if LAST_LOG.swap(now, Ordering::Relaxed) != now {
                    let peer = peer.map_or_else(|| "?".to_string(), |p| p.to_string());
                    match why {
                        Refused::Malformed(what) => {
                            log::warn!("PROXY protocol: closed a connection from {peer}: {what}")
                        }
                        _ => log::warn!(
                            "PROXY protocol: closed a connection from {peer}: {}",
                            why.label()
                        ),
                    }
                }
                false
            }
        }
    }

    async fn read(&self, l4: &mut L4Stream, peer: Option<SocketAddr>) -> Result<Header, Refused> {
        if !peer.is_some_and(|p| self.spec.from.iter().any(|c| c.contains(p.ip()))) {
            return Err(Refused::Source);
        }
        let mut buf = Vec::with_capacity(MAX_V1 + 1);
        let read = async {
            loop {
                let mut chunk = [0u8; 512];
                // Never read past the longest header: what follows it goes
                // back into the stream, and a slow sender cannot make this
                // buffer grow.
                let room = (MAX_V2 - buf.len()).min(chunk.len());
                let n = l4
                    .read(&mut chunk[..room])
                    .await
                    .map_err(|_| Refused::Missing)?;
                if n == 0 {
                    return Err(Refused::Missing);
                }
                buf.extend_from_slice(&chunk[..n]);
                match parse(&buf) {
                    Ok((h, used)) => return Ok((h, used)),
                    Err(Bad::Incomplete) if buf.len() < MAX_V2 => continue,
                    Err(Bad::Incomplete) => return Err(Refused::Malformed("header too long")),
                    Err(Bad::Malformed(what)) => return Err(Refused::Malformed(what)),
                }
            }
        };
        let (h, used) = tokio::time::timeout(self.spec.timeout, read)
            .await
            .map_err(|_| Refused::Timeout)??;
        l4.rewind(&buf[used..]);
        Ok(h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v2_header(cmd: u8, fam: u8, addrs: &[u8], tlvs: &[u8]) -> Vec<u8> {
        let mut h = SIG.to_vec();
        h.push(0x20 | cmd);
        h.push(fam);
        h.extend_from_slice(&((addrs.len() + tlvs.len()) as u16).to_be_bytes());
        h.extend_from_slice(addrs);
        h.extend_from_slice(tlvs);
        h
    }

    #[test]
    fn v1_tcp4_tcp6_and_unknown() {
        let b = b"PROXY TCP4 192.0.2.7 10.0.0.1 56324 443\r\nGET / HTTP/1.1\r\n";
        let (h, n) = parse(b).unwrap();
        assert_eq!(&b[n..], b"GET / HTTP/1.1\r\n");
        assert_eq!(
            h,
            Header::Proxied {
                source: "192.0.2.7:56324".parse().unwrap(),
                destination: "10.0.0.1:443".parse().unwrap()
            }
        );
        let (h, _) = parse(b"PROXY TCP6 2001:db8::1 ::1 1 65535\r\n").unwrap();
        assert!(
            matches!(h, Header::Proxied { source, .. } if source == "[2001:db8::1]:1".parse().unwrap())
        );
        assert_eq!(
            parse(b"PROXY UNKNOWN whatever\r\n").unwrap().0,
            Header::Local
        );
    }

    #[test]
    fn v1_refusals() {
        for bad in [
            &b"PROXY TCP4 192.0.2.7 10.0.0.1 56324\r\n"[..],
            b"PROXY TCP4 2001:db8::1 10.0.0.1 1 2\r\n",
            b"PROXY TCP4 192.0.2.7 10.0.0.1 65536 2\r\n",
            b"PROXY TCP4 192.0.2.7 10.0.0.1 01 2\r\n",
            b"PROXY UDP4 192.0.2.7 10.0.0.1 1 2\r\n",
            b"PROXY TCP4 192.0.2.7 10.0.0.1 1 2 3\r\n",
            b"GET / HTTP/1.1\r\n",
        ] {
            assert!(
                matches!(parse(bad), Err(Bad::Malformed(_))),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        assert_eq!(parse(b"PROXY TCP4 192.0.2.7"), Err(Bad::Incomplete));
        assert_eq!(parse(b"PRO"), Err(Bad::Incomplete));
        let long = [b"PROXY TCP4 ".as_slice(), &[b'1'; 120]].concat();
        assert!(matches!(parse(&long), Err(Bad::Malformed(_))));
    }

    #[test]
    fn v2_ipv4_ipv6_local_and_tlvs() {
        let addrs = [192, 0, 2, 7, 10, 0, 0, 1, 0xdc, 0x04, 0x01, 0xbb];
        let tlvs = [0x01, 0x00, 0x02, b'h', b'2'];
        let mut b = v2_header(1, 0x11, &addrs, &tlvs);
        let len = b.len();
        b.extend_from_slice(b"\x16\x03\x01");
        let (h, n) = parse(&b).unwrap();
        assert_eq!(n, len);
        assert_eq!(
            h,
            Header::Proxied {
                source: "192.0.2.7:56324".parse().unwrap(),
                destination: "10.0.0.1:443".parse().unwrap()
            }
        );
        let mut a6 = Vec::new();
        a6.extend_from_slice(&"2001:db8::9".parse::<Ipv6Addr>().unwrap().octets());
        a6.extend_from_slice(&Ipv6Addr::LOCALHOST.octets());
        a6.extend_from_slice(&[0x00, 0x50, 0x01, 0xbb]);
        let (h, _) = parse(&v2_header(1, 0x21, &a6, &[])).unwrap();
        assert!(
            matches!(h, Header::Proxied { source, .. } if source == "[2001:db8::9]:80".parse().unwrap())
        );
        assert_eq!(
            parse(&v2_header(0, 0x00, &[], &[])).unwrap().0,
            Header::Local
        );
        // A unix-socket family carries no client address.
        assert_eq!(
            parse(&v2_header(1, 0x31, &[0; 216], &[])).unwrap().0,
            Header::Local
        );
    }

    #[test]
    fn v2_refusals_and_bounds() {
        let addrs = [192, 0, 2, 7, 10, 0, 0, 1, 0, 1, 0, 2];
        let full = v2_header(1, 0x11, &addrs, &[]);
        for cut in 1..full.len() {
            assert_eq!(parse(&full[..cut]), Err(Bad::Incomplete), "cut at {cut}");
        }
        let mut bad_ver = full.clone();
        bad_ver[12] = 0x11;
        assert!(matches!(parse(&bad_ver), Err(Bad::Malformed(_))));
        let mut bad_cmd = full.clone();
        bad_cmd[12] = 0x22;
        assert!(matches!(parse(&bad_cmd), Err(Bad::Malformed(_))));
        assert!(matches!(
            parse(&v2_header(1, 0x11, &addrs[..8], &[])),
            Err(Bad::Malformed(_))
        ));
        let mut huge = SIG.to_vec();
        huge.extend_from_slice(&[0x21, 0x11, 0xff, 0xff]);
        assert!(matches!(parse(&huge), Err(Bad::Malformed(_))));
    }
}
