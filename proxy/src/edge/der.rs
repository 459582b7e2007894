//! Just enough DER to read two dates, a certificate's `notAfter` (for the
//! expiry metric) and an OCSP response's `nextUpdate` (a staple past it is
//! not served), and the certificate ids an OCSP response speaks for (a
//! staple for another certificate is refused at load). Every read is
//! bounds-checked; malformed input is `None`.

/// One TLV: (tag, content, rest).
fn tlv(b: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let tag = *b.first()?;
    let first = *b.get(1)? as usize;
    let (len, hdr) = if first < 0x80 {
        (first, 2)
    } else {
        let n = first & 0x7f;
        if n == 0 || n > 4 {
            return None;
        }
        let mut len = 0usize;
        for i in 0..n {
            len = (len << 8) | *b.get(2 + i)? as usize;
        }
        (len, 2 + n)
    };
    let end = hdr.checked_add(len)?;
    Some((tag, b.get(hdr..end)?, b.get(end..)?))
}

/// One element: its tag, its content and its whole encoding.
struct Raw<'a> {
    tag: u8,
    content: &'a [u8],
    whole: &'a [u8],
}

/// One TLV with its raw encoding, and the rest.
fn tlv_raw(b: &[u8]) -> Option<(Raw<'_>, &[u8])> {
    let (tag, content, rest) = tlv(b)?;
    let whole = b.get(..b.len() - rest.len())?;
    Some((
        Raw {
            tag,
            content,
            whole,
        },
        rest,
    ))
}

/// The elements of a constructed value.
fn children(mut b: &[u8]) -> Option<Vec<(u8, &[u8])>> {
    let mut out = Vec::new();
    while !b.is_empty() {
        let (t, c, rest) = tlv(b)?;
        out.push((t, c));
        b = rest;
    }
    Some(out)
}

/// UTCTime (0x17) or GeneralizedTime (0x18) to unix seconds.
fn time(tag: u8, c: &[u8]) -> Option<i64> {
    let s = std::str::from_utf8(c).ok()?.strip_suffix('Z')?;
    let (year, rest) = match tag {
        0x17 => {
            let y: i64 = s.get(0..2)?.parse().ok()?;
            (if y < 50 { 2000 + y } else { 1900 + y }, s.get(2..)?)
        }
        0x18 => (s.get(0..4)?.parse().ok()?, s.get(4..)?),
        _ => return None,
    };
    let num = |r: std::ops::Range<usize>| -> Option<i64> { rest.get(r)?.parse().ok() };
    let (mo, d, h, mi, se) = (num(0..2)?, num(2..4)?, num(4..6)?, num(6..8)?, num(8..10)?);
    // days_from_civil (Howard Hinnant).
    let y = if mo <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (if mo > 2 { mo - 3 } else { mo + 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(days * 86_400 + h * 3600 + mi * 60 + se)
}

/// `notAfter` of an X.509 certificate, unix seconds.
pub fn cert_not_after(der: &[u8]) -> Option<i64> {
    let (_, cert, _) = tlv(der)?;
    let (_, tbs, _) = tlv(cert)?;
    let fields = children(tbs)?;
    // [0] version is optional; validity follows serial, signature, issuer.
    let skip = usize::from(fields.first()?.0 == 0xa0);
    let (_, validity) = fields.get(skip + 3)?;
    let v = children(validity)?;
    let (tag, c) = v.get(1)?;
    time(*tag, c)
}

/// What identifies a certificate to OCSP (RFC 6960 `CertID`): the serial,
/// the hash of the issuer's name and, with the issuer, of its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertId {
    /// Hash algorithm OID (content bytes).
    pub hash_oid: Vec<u8>,
    /// Hash of the issuer's DER `Name`.
    pub issuer_name_hash: Vec<u8>,
    /// Hash of the issuer's public key bits.
    pub issuer_key_hash: Vec<u8>,
    /// Serial number (INTEGER content).
    pub serial: Vec<u8>,
}

/// SHA-1 (1.3.14.3.2.26), what OCSP clients and `openssl ocsp` use.
pub const OID_SHA1: &[u8] = &[0x2b, 0x0e, 0x03, 0x02, 0x1a];
/// SHA-256 (2.16.840.1.101.3.4.2.1).
pub const OID_SHA256: &[u8] = &[0x60, 0x86, 0x48, 0x01, 0x65, 0x03, 0x04, 0x02, 0x01];

/// A certificate's TBS fields with their raw encodings, version skipped.
fn tbs_fields(der: &[u8]) -> Option<Vec<Raw<'_>>> {
    let (_, cert, _) = tlv(der)?;
    let (_, mut tbs, _) = tlv(cert)?;
    let mut out = Vec::new();
    while !tbs.is_empty() {
        let (raw, rest) = tlv_raw(tbs)?;
        if raw.tag != 0xa0 {
            out.push(raw);
        }
        tbs = rest;
    }
    Some(out)
}

/// A certificate's serial (INTEGER content) and its issuer `Name` (raw).
pub fn cert_serial_and_issuer(der: &[u8]) -> Option<(&[u8], &[u8])> {
    let f = tbs_fields(der)?;
    // serial, signature, issuer, validity, subject, subjectPublicKeyInfo
    Some((f.first()?.content, f.get(2)?.whole))
}

/// A certificate's subject `Name` (raw) and public key bits (the BIT STRING
/// without its unused-bits byte), as an issuer of others.
pub fn cert_subject_and_key(der: &[u8]) -> Option<(&[u8], &[u8])> {
    let f = tbs_fields(der)?;
    let subject = f.get(4)?.whole;
    let spki = children(f.get(5)?.content)?;
    let (tag, bits) = spki.get(1)?;
    (*tag == 0x03).then_some(())?;
    Some((subject, bits.get(1..)?))
}

/// The certificate ids of an OCSP response's single responses; `None` when
/// malformed or when the response is not `successful`.
pub fn ocsp_cert_ids(der: &[u8]) -> Option<Vec<CertId>> {
    let mut out = Vec::new();
    for single in ocsp_singles(der)? {
        let fields = children(single)?;
        let id = children(fields.first()?.1)?;
        let alg = children(id.first()?.1)?;
        out.push(CertId {
            hash_oid: alg.first()?.1.to_vec(),
            issuer_name_hash: id.get(1)?.1.to_vec(),
            issuer_key_hash: id.get(2)?.1.to_vec(),
            serial: id.get(3)?.1.to_vec(),
        });
    }
    Some(out)
}

/// The `SingleResponse` contents of a successful basic OCSP response.
fn ocsp_singles(der: &[u8]) -> Option<Vec<&[u8]>> {
    let (_, resp, _) = tlv(der)?;
    let parts = children(resp)?;
    if parts.first()?.1 != [0] {
        return None; // responseStatus != successful
    }
    let (_, bytes_explicit) = parts.get(1)?;
    let (_, response_bytes, _) = tlv(bytes_explicit)?;
    let rb = children(response_bytes)?;
    let (_, basic_octets) = rb.get(1)?;
    let (_, basic, _) = tlv(basic_octets)?;
    let (_, tbs, _) = tlv(basic)?;
    let fields = children(tbs)?;
    let skip = usize::from(fields.first()?.0 == 0xa0);
    // responderID, producedAt, responses
    let (_, responses) = fields.get(skip + 2)?;
    Some(children(responses)?.into_iter().map(|(_, c)| c).collect())
}

/// The earliest `nextUpdate` among an OCSP response's single responses;
/// `None` when malformed or when the response is not `successful`.
pub fn ocsp_next_update(der: &[u8]) -> Option<i64> {
    let mut earliest: Option<i64> = None;
    for single in ocsp_singles(der)? {
        for (tag, c) in children(single)? {
            if tag == 0xa0 {
                let (t, inner, _) = tlv(c)?;
                let when = time(t, inner)?;
                earliest = Some(earliest.map_or(when, |e| e.min(when)));
            }
        }
    }
    earliest
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times() {
        assert_eq!(time(0x18, b"19700101000000Z"), Some(0));
        assert_eq!(time(0x17, b"240229123456Z"), Some(1_709_210_096));
        assert_eq!(time(0x18, b"garbage"), None);
    }

    #[test]
    fn garbage_is_none_not_a_panic() {
        for b in [
            &[][..],
            &[0x30],
            &[0x30, 0x85, 1, 2, 3, 4, 5],
            &[0x30, 0x02, 0x30, 0xff],
        ] {
            assert_eq!(cert_not_after(b), None);
            assert_eq!(ocsp_next_update(b), None);
            assert_eq!(ocsp_cert_ids(b), None);
            assert_eq!(cert_serial_and_issuer(b), None);
            assert_eq!(cert_subject_and_key(b), None);
        }
    }
}
