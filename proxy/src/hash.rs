//! Hashes every rank may use: splitmix64, FNV-1a over bytes, and the key
//! a consistent-hash pool or a rate limit derives from a request. A leaf:
//! it names no other module.

/// How a consistent-hash pool derives its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HashKey {
    /// The client's IP address.
    ClientIp,
    /// A request header's value.
    Header(http::HeaderName),
    /// A cookie's value.
    Cookie(String),
}

/// splitmix64: a cheap, well-mixed 64-bit permutation.
pub fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// FNV-1a over bytes, finished with `mix64`: stable across runs and builds.
pub fn hash_bytes(b: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for x in b {
        h ^= *x as u64;
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    mix64(h)
}
