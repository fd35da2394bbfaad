//! What the host allows a product: how fast threads read bytes, and (with
//! [`crate::quant_kernel::int8_mac_rate`] and [`f32_fma_rate`]) how fast they multiply. A few-row
//! product can go no faster than the slower of its bytes at the read rate and its
//! multiply-accumulates at the MAC rate; kernels and benchmarks print their times beside that
//! roof.

use std::time::Instant;

/// Bytes per second `threads` threads read `regions` together, each summing a contiguous share
/// of them (in 64-byte lanes the compiler vectorises); the best of a few passes, so that one
/// disturbed by the host's neighbours does not count.
pub fn read_rate(threads: usize, regions: &[&[u8]]) -> f64 {
    const PASSES: usize = 4;
    let total: usize = regions.iter().map(|r| r.len()).sum();
    let shares = shares(regions, total.div_ceil(threads.max(1)).max(1));
    let mut best = f64::INFINITY;
    for _ in 0..PASSES {
        let start = Instant::now();
        let share_sum = |share: &Vec<&[u8]>| share.iter().map(|r| lane_sum(r)).sum::<u64>();
        // The first share on this thread, as the kernels' pools run their first part: a thread
        // of its own could land on another core, which reads what this one wrote more slowly.
        let sum: u64 = std::thread::scope(|scope| {
            let others: Vec<_> = shares[1..]
                .iter()
                .map(|share| scope.spawn(move || share_sum(share)))
                .collect();
            let first = share_sum(&shares[0]);
            first
                + others
                    .into_iter()
                    .map(|s| s.join().unwrap_or(0))
                    .sum::<u64>()
        });
        std::hint::black_box(sum);
        best = best.min(start.elapsed().as_secs_f64());
    }
    total as f64 / best
}

/// `regions` cut into consecutive shares of about `share_bytes` each.
fn shares<'a>(regions: &[&'a [u8]], share_bytes: usize) -> Vec<Vec<&'a [u8]>> {
    let mut shares = vec![Vec::new()];
    let mut room = share_bytes;
    for &region in regions {
        let mut rest = region;
        while !rest.is_empty() {
            if room == 0 {
                shares.push(Vec::new());
                room = share_bytes;
            }
            let (head, tail) = rest.split_at(room.min(rest.len()));
            shares.last_mut().expect("a share").push(head);
            room -= head.len();
            rest = tail;
        }
    }
    shares
}

/// A sum of `bytes` in eight independent 64-bit lanes (vectorised; no dependency chain to wait
/// on), the unaligned ends byte by byte.
fn lane_sum(bytes: &[u8]) -> u64 {
    // SAFETY: any bytes are valid u64s.
    let (head, words, tail) = unsafe { bytes.align_to::<u64>() };
    let mut lanes = [0u64; 8];
    let chunks = words.chunks_exact(8);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (lane, value) in lanes.iter_mut().zip(chunk) {
            *lane = lane.wrapping_add(*value);
        }
    }
    let ends = head.iter().chain(tail).map(|&b| b as u64);
    let rest = rest.iter().copied().chain(ends);
    lanes.iter().copied().chain(rest).fold(0, u64::wrapping_add)
}

/// f32 multiply-adds per second one thread does with 256-bit FMAs on its registers (eight a
/// `vfmadd`): the compute roof of row attention and of products with f32 or bf16 weights, which
/// the row kernels run as such FMAs; on AVX-512 hosts the same FMAs run on the same pipes (Zen 4
/// splits a 512-bit one in two). Best of five runs of about a millisecond; `None` where the row
/// kernels do not run (no AVX2 and FMA).
pub fn f32_fma_rate() -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    if crate::row_kernel::available() {
        const ROUNDS: usize = 1 << 15;
        let best = (0..5)
            .map(|_| {
                let start = Instant::now();
                // SAFETY: AVX2 and FMA are available (the row kernel's condition).
                unsafe { fma::rounds(ROUNDS) };
                start.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min);
        return Some((ROUNDS * fma::CHAINS * fma::LANES) as f64 / best);
    }
    None
}

#[cfg(target_arch = "x86_64")]
mod fma {
    use std::arch::x86_64::*;

    /// Independent accumulator chains: enough to cover the FMA's latency (4 cycles) on both
    /// pipes of the hosts seen.
    pub(super) const CHAINS: usize = 12;
    pub(super) const LANES: usize = 8;

    /// `rounds` rounds of one FMA on each of [`CHAINS`] accumulators, each the last round's
    /// result halved plus a constant (bounded: nothing overflows or turns subnormal).
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn rounds(rounds: usize) {
        let (half, one) = (_mm256_set1_ps(0.5), _mm256_set1_ps(1.0));
        let mut sums = [_mm256_set1_ps(3.0); CHAINS];
        for _ in 0..rounds {
            for sum in sums.iter_mut() {
                *sum = _mm256_fmadd_ps(*sum, half, one);
            }
        }
        std::hint::black_box(sums);
    }
}

/// The fastest a product of `bytes` weight bytes and `macs` multiply-accumulates can run, in
/// seconds, at `read_rate` bytes and `mac_rate` MACs per second.
pub fn roofline_seconds(bytes: f64, macs: f64, read_rate: f64, mac_rate: f64) -> f64 {
    (bytes / read_rate).max(macs / mac_rate)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_cover_every_byte_once_in_order() {
        let (a, b, c) = (vec![1u8; 10], vec![2u8; 3], vec![3u8; 7]);
        let regions = [&a[..], &b[..], &c[..]];
        let shares = shares(&regions, 8);
        let lens: Vec<usize> = shares
            .iter()
            .map(|s| s.iter().map(|r| r.len()).sum())
            .collect();
        assert_eq!(lens, [8, 8, 4]);
        let flat: Vec<u8> = shares
            .iter()
            .flatten()
            .flat_map(|r| r.iter().copied())
            .collect();
        assert_eq!(flat, [a, b, c].concat());
        // Every byte is read: a single non-zero byte anywhere (aligned or not) shows in the sum.
        for at in 0..203 {
            let mut bytes = vec![0u8; 203];
            bytes[at] = 1;
            assert_ne!(lane_sum(&bytes[at.min(3)..]), 0, "byte {at}");
        }
        assert_eq!(lane_sum(&[7u8; 5]), 35);
    }

    #[test]
    fn the_roof_is_the_slower_of_reading_and_multiplying() {
        assert_eq!(roofline_seconds(10.0, 1.0, 5.0, 1.0), 2.0);
        assert_eq!(roofline_seconds(10.0, 30.0, 5.0, 10.0), 3.0);
        let bytes = vec![1u8; 1 << 20];
        assert!(read_rate(2, &[&bytes]) > 1e8);
    }

    /// Any host the row kernels run on does some billions of FMAs a second; far more than the
    /// clock could allow would mean the loop was optimised away.
    #[test]
    fn the_fma_rate_is_a_host_rate() {
        if let Some(rate) = f32_fma_rate() {
            assert!((1e9..1e12).contains(&rate), "{rate}");
        }
    }
}
