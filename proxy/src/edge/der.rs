//! Just enough DER to read two dates: a certificate's `notAfter` (for the
//! expiry metric) and an OCSP response's `nextUpdate` (a staple past it is
//! not served). Every read is bounds-checked; malformed input is `None`.

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

/// The earliest `nextUpdate` among an OCSP response's single responses;
/// `None` when malformed or when the response is not `successful`.
pub fn ocsp_next_update(der: &[u8]) -> Option<i64> {
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
    let mut earliest: Option<i64> = None;
    for (_, single) in children(responses)? {
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
        }
    }
}
