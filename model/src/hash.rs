//! Stable 64-bit hashes for keys that must not change between runs, machines or Rust releases
//! (std's `DefaultHasher` makes no such promise): the train / held-out split, seeds derived from
//! ids, the random weights of test models. FNV-1a 64 (offset basis `0xcbf29ce484222325`, prime
//! `0x100000001b3`) and the SplitMix64 mixer, written out.

/// FNV-1a, 64 bits.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    const OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    bytes.iter().fold(OFFSET_BASIS, |hash, &b| {
        (hash ^ u64::from(b)).wrapping_mul(PRIME)
    })
}

/// The SplitMix64 finaliser: a bijection on `u64` in which every input bit affects every output
/// bit.
pub fn mix64(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}
