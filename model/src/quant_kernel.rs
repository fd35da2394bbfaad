//! `y = x Wᵀ` for a [`QuantMatrix`] `W`, reading its blocks as stored.
//!
//! Activations are quantised first, per row and per 32-value block, to 8-bit integers with an f32
//! scale (`d = max|x| / 127`, `q = round(x / d)`): llama.cpp's `Q8` activation format, but with
//! an f32 rather than f16 scale. Each block product is an exact integer dot product; eight
//! blocks' integers are reduced to one vector (lane `j` block `j` of the eight), converted and
//! multiplied by the eight scales `d_w · d_x` in one FMA; `Q4_1`'s minimum adds `m_w · d_x Σq_x`
//! in a second FMA on the same lanes. The result differs from the f32 product of the dequantised
//! weights by the activations' rounding (a relative error of about 0.3 % per block, which
//! averages out over a row; the parity tests state the bound).
//!
//! Every output `y[r][o]` runs the same operations in the same order whatever the number of rows
//! beside it, the thread split, or the instruction set: the integer sums are exact, so AVX2's
//! `maddubs`+`madd` and AVX-512 VNNI's `dpbusd`, and any order of reducing them, give the same
//! integers, and the float sequence (per eight blocks one or two FMAs per lane, then a fixed
//! horizontal sum) is fixed. The portable fallback [`reference_dot`] replays that sequence lane by
//! lane and is bit-identical, which the tests check.
//!
//! Why eight blocks per vector: the scales of a block are scalars, and scaling each block's eight
//! partial sums on its own (one conversion, a scalar product, a broadcast and an FMA per block)
//! made the kernel compute-bound at about twice the instructions per block.

use crate::quant::{f16_at, QuantFormat, QuantMatrix, BLOCK};

/// Lanes of the f32 accumulator and the integer sums: 8 (one AVX2 register), also the blocks
/// whose scales one vector holds.
const LANES: usize = 8;

/// Activation rows quantised to 8 bits per 32-value block.
pub struct QuantisedRows {
    cols: usize,
    /// `rows × cols` quantised values.
    q: Vec<i8>,
    /// Per block, each row padded with zeros to a whole number of [`LANES`] blocks (so that
    /// eight blocks load as one vector): the scale `d`,
    d: Vec<f32>,
    /// `d · Σq`, what a weight minimum (`Q4_1`) multiplies,
    sum: Vec<f32>,
    /// and `Σq` (`Q4_0`'s offset of 8 subtracts `8 Σq` from the unsigned weights' product).
    q_sum: Vec<i32>,
}

impl QuantisedRows {
    /// Quantises `x`, `rows × cols` floats (`cols` a multiple of 32).
    pub fn new(x: &[f32], cols: usize) -> Self {
        assert!(cols.is_multiple_of(BLOCK), "rows of whole blocks");
        let blocks_per_row = cols / BLOCK;
        let stride = padded_blocks(blocks_per_row);
        let padded = x.len() / cols.max(1) * stride;
        let mut rows = Self {
            cols,
            q: vec![0; x.len()],
            d: vec![0.0; padded],
            sum: vec![0.0; padded],
            q_sum: vec![0; padded],
        };
        for (at, (values, q)) in x
            .chunks_exact(BLOCK)
            .zip(rows.q.chunks_exact_mut(BLOCK))
            .enumerate()
        {
            let amax = values.iter().fold(0f32, |a, v| a.max(v.abs()));
            let d = amax / 127.0;
            let inverse = if d != 0.0 { 1.0 / d } else { 0.0 };
            let mut total = 0i32;
            for (value, q) in values.iter().zip(q.iter_mut()) {
                *q = (value * inverse).round() as i8;
                total += i32::from(*q);
            }
            let padded_at = at / blocks_per_row * stride + at % blocks_per_row;
            rows.d[padded_at] = d;
            rows.sum[padded_at] = d * total as f32;
            rows.q_sum[padded_at] = total;
        }
        rows
    }

    fn blocks_per_row(&self) -> usize {
        self.cols / BLOCK
    }
}

/// Entries per row of the per-block vectors of [`QuantisedRows`]: the blocks rounded up to whole
/// vectors.
fn padded_blocks(blocks: usize) -> usize {
    blocks.div_ceil(LANES) * LANES
}

/// The instruction set [`columns`] runs on, chosen once per process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// AVX-512 VNNI (`vpdpbusd` on 256-bit registers).
    Vnni,
    /// AVX2 with FMA and F16C.
    Avx2,
    /// Plain Rust, [`reference_dot`].
    Portable,
}

/// The best [`Isa`] this CPU has.
pub fn detected_isa() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 = is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c");
        if avx2 && is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl") {
            return Isa::Vnni;
        }
        if avx2 {
            return Isa::Avx2;
        }
    }
    Isa::Portable
}

/// Weight rows per block, activation rows per pass: as in [`crate::row_kernel`] (a block of
/// quantised rows stays in L1/L2 while activation rows pass over it).
const COLUMN_BLOCK: usize = 64;
const ROW_BLOCK: usize = 4;

/// Computes columns `first..first + len` of `y = x wᵀ` (`y` row-major with `y_stride` floats per
/// row) on `isa`.
///
/// # Safety
/// `isa` must be available on this CPU; `y` must hold `rows × y_stride` floats with
/// `first + len ≤ min(y_stride, w.rows())`; no other thread may write those columns meanwhile.
pub unsafe fn columns(
    isa: Isa,
    x: &QuantisedRows,
    w: &QuantMatrix,
    y: *mut f32,
    y_stride: usize,
    first: usize,
    len: usize,
) {
    assert_eq!(x.cols, w.cols(), "activation and weight widths");
    let rows = x.q.len() / x.cols.max(1);
    let end = first + len;
    let mut block = first;
    while block < end {
        let block_end = (block + COLUMN_BLOCK).min(end);
        let mut row = 0;
        while row < rows {
            let rows_end = (row + ROW_BLOCK).min(rows);
            for column in block..block_end {
                let tile = Tile { row, column };
                match rows_end - row {
                    1 => tile.run::<1>(isa, x, w, y, y_stride),
                    2 => tile.run::<2>(isa, x, w, y, y_stride),
                    3 => tile.run::<3>(isa, x, w, y, y_stride),
                    _ => tile.run::<4>(isa, x, w, y, y_stride),
                }
            }
            row = rows_end;
        }
        block = block_end;
    }
}

/// The outputs of weight row `column` and activation rows `row..row + R`.
#[derive(Clone, Copy)]
struct Tile {
    row: usize,
    column: usize,
}

impl Tile {
    unsafe fn run<const R: usize>(
        self,
        isa: Isa,
        x: &QuantisedRows,
        w: &QuantMatrix,
        y: *mut f32,
        y_stride: usize,
    ) {
        use QuantFormat::*;
        const Q4_0_CODE: u8 = Q4_0.code();
        const Q4_1_CODE: u8 = Q4_1.code();
        const Q8_0_CODE: u8 = Q8_0.code();
        let out: [f32; R] = match (isa, w.format()) {
            #[cfg(target_arch = "x86_64")]
            (Isa::Vnni, Q4_0) => simd::tile_vnni::<Q4_0_CODE, R>(self, x, w),
            #[cfg(target_arch = "x86_64")]
            (Isa::Vnni, Q4_1) => simd::tile_vnni::<Q4_1_CODE, R>(self, x, w),
            #[cfg(target_arch = "x86_64")]
            (Isa::Vnni, Q8_0) => simd::tile_vnni::<Q8_0_CODE, R>(self, x, w),
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx2, Q4_0) => simd::tile_avx2::<Q4_0_CODE, R>(self, x, w),
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx2, Q4_1) => simd::tile_avx2::<Q4_1_CODE, R>(self, x, w),
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx2, Q8_0) => simd::tile_avx2::<Q8_0_CODE, R>(self, x, w),
            _ => std::array::from_fn(|r| reference_dot(w, self.column, x, self.row + r)),
        };
        for (r, value) in out.into_iter().enumerate() {
            *y.add((self.row + r) * y_stride + self.column) = value;
        }
    }
}

/// One weight block's integers in element order: `Q4_1`'s 0..15, `Q4_0`'s −8..7, `Q8_0`'s bytes.
fn block_values(format: QuantFormat, block: &[u8]) -> [i8; BLOCK] {
    let mut out = [0i8; BLOCK];
    match format {
        QuantFormat::Q4_0 | QuantFormat::Q4_1 => {
            let (nibbles, offset) = match format {
                QuantFormat::Q4_0 => (&block[2..18], 8),
                _ => (&block[4..20], 0),
            };
            for (j, &byte) in nibbles.iter().enumerate() {
                out[j] = (byte & 0x0f) as i8 - offset;
                out[j + BLOCK / 2] = (byte >> 4) as i8 - offset;
            }
        }
        QuantFormat::Q8_0 => {
            for (o, &b) in out.iter_mut().zip(&block[2..2 + BLOCK]) {
                *o = b as i8;
            }
        }
    }
    out
}

/// `y[row][column]` computed one lane at a time, in exactly the order the SIMD tiles use.
pub fn reference_dot(w: &QuantMatrix, column: usize, x: &QuantisedRows, row: usize) -> f32 {
    let format = w.format();
    let block_bytes = format.block_bytes();
    let w_row = &w.data()[column * w.row_bytes()..(column + 1) * w.row_bytes()];
    let blocks = x.blocks_per_row();
    let mut lanes = [0f32; LANES];
    for group in (0..blocks).step_by(LANES) {
        for (lane, acc) in lanes.iter_mut().enumerate() {
            let (b, at) = (group + lane, row * padded_blocks(blocks) + group + lane);
            // Lanes past the last block hold zeros, and run the same FMAs.
            let (total, d_w, m_w) = match w_row.get(b * block_bytes..(b + 1) * block_bytes) {
                Some(block) => {
                    let xq = &x.q[(row * blocks + b) * BLOCK..][..BLOCK];
                    let total: i32 = block_values(format, block)
                        .iter()
                        .zip(xq)
                        .map(|(&w, &x)| i32::from(w) * i32::from(x))
                        .sum();
                    (total, f16_at(block, 0), f16_at(block, 2))
                }
                None => (0, 0.0, 0.0),
            };
            *acc = (total as f32).mul_add(d_w * x.d[at], *acc);
            if format == QuantFormat::Q4_1 {
                *acc = m_w.mul_add(x.sum[at], *acc);
            }
        }
    }
    horizontal_sum(lanes)
}

/// The order `simd::horizontal_sum` adds 8 lanes in: halves, then pairs, then the last two.
fn horizontal_sum(l: [f32; LANES]) -> f32 {
    let quad = [l[0] + l[4], l[1] + l[5], l[2] + l[6], l[3] + l[7]];
    let pair = [quad[0] + quad[2], quad[1] + quad[3]];
    pair[0] + pair[1]
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    use super::{padded_blocks, QuantisedRows, Tile, BLOCK, LANES};
    use crate::quant::{QuantFormat, QuantMatrix};

    /// The kernel for one instruction set: `$dot4` sums four adjacent products of unsigned and
    /// signed bytes into each i32 lane.
    macro_rules! tile_kernel {
        ($name:ident, $features:literal, $dot4:ident) => {
            #[target_feature(enable = $features)]
            pub(crate) unsafe fn $name<const FORMAT: u8, const R: usize>(
                tile: Tile,
                x: &QuantisedRows,
                w: &QuantMatrix,
            ) -> [f32; R] {
                // A constant in each instance, so that every format gets its own loop.
                let format = QuantFormat::from_code(FORMAT);
                let block_bytes = format.block_bytes();
                let w_row = w.data().as_ptr().add(tile.column * w.row_bytes());
                let blocks = x.blocks_per_row();
                let stride = padded_blocks(blocks);
                let lane_ids = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                let offsets = _mm256_mullo_epi32(lane_ids, _mm256_set1_epi32(block_bytes as i32));
                let mut acc = [_mm256_setzero_ps(); R];
                for group in (0..blocks).step_by(LANES) {
                    let count = (blocks - group).min(LANES);
                    let first = w_row.add(group * block_bytes);
                    // Lane j: block j's exact integer product with each row (four blocks per
                    // half; a group of up to four leaves the upper half zero).
                    let mut halves = [[_mm_setzero_si128(); 2]; R];
                    for quad in 0..count.div_ceil(4) {
                        let mut pairs = [[_mm256_setzero_si256(); 2]; R];
                        for (pair, offset) in [(0, 0), (1, 2)] {
                            let j = quad * 4 + offset;
                            let a =
                                block_products::<FORMAT, R>(first, j, count, x, tile.row, group);
                            let b = block_products::<FORMAT, R>(
                                first,
                                j + 1,
                                count,
                                x,
                                tile.row,
                                group,
                            );
                            for r in 0..R {
                                pairs[r][pair] = _mm256_hadd_epi32(a[r], b[r]);
                            }
                        }
                        for r in 0..R {
                            let four = _mm256_hadd_epi32(pairs[r][0], pairs[r][1]);
                            halves[r][quad] = _mm_add_epi32(
                                _mm256_castsi256_si128(four),
                                _mm256_extracti128_si256(four, 1),
                            );
                        }
                    }
                    let valid = _mm256_cmpgt_epi32(_mm256_set1_epi32(count as i32), lane_ids);
                    // Each block's first four bytes: `d` (and `Q4_1`'s `m`).
                    let words = _mm256_mask_i32gather_epi32(
                        _mm256_setzero_si256(),
                        first as *const i32,
                        offsets,
                        valid,
                        1,
                    );
                    let d_w = f16_lanes(_mm256_and_si256(words, _mm256_set1_epi32(0xffff)));
                    for r in 0..R {
                        let at = (tile.row + r) * stride + group;
                        let mut ints = _mm256_set_m128i(halves[r][1], halves[r][0]);
                        if format == QuantFormat::Q4_0 {
                            let q_sum =
                                _mm256_loadu_si256(x.q_sum.as_ptr().add(at) as *const __m256i);
                            ints = _mm256_sub_epi32(ints, _mm256_slli_epi32(q_sum, 3));
                        }
                        let scale = _mm256_mul_ps(d_w, _mm256_loadu_ps(x.d.as_ptr().add(at)));
                        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ints), scale, acc[r]);
                        if format == QuantFormat::Q4_1 {
                            let m_w = f16_lanes(_mm256_srli_epi32(words, 16));
                            let sums = _mm256_loadu_ps(x.sum.as_ptr().add(at));
                            acc[r] = _mm256_fmadd_ps(m_w, sums, acc[r]);
                        }
                    }
                }
                std::array::from_fn(|r| horizontal_sum(acc[r]))
            }

            /// Block `j` of the group at `first`: its integer products with rows
            /// `row..row + R` in 8 lanes (zeros past `count`); `Q4_0`'s weights unsigned
            /// (0..15, the offset subtracted per group).
            #[target_feature(enable = $features)]
            #[inline]
            unsafe fn block_products<const FORMAT: u8, const R: usize>(
                first: *const u8,
                j: usize,
                count: usize,
                x: &QuantisedRows,
                row: usize,
                group: usize,
            ) -> [__m256i; R] {
                let format = QuantFormat::from_code(FORMAT);
                if j >= count {
                    return [_mm256_setzero_si256(); R];
                }
                let block = first.add(j * format.block_bytes());
                let (weights, signs) = match format {
                    QuantFormat::Q4_1 => (nibbles(block.add(4)), None),
                    QuantFormat::Q4_0 => (nibbles(block.add(2)), None),
                    QuantFormat::Q8_0 => {
                        let signed = _mm256_loadu_si256(block.add(2) as *const __m256i);
                        (_mm256_sign_epi8(signed, signed), Some(signed))
                    }
                };
                let blocks = x.blocks_per_row();
                std::array::from_fn(|r| {
                    let at = (row + r) * blocks + group + j;
                    let mut xv = _mm256_loadu_si256(x.q.as_ptr().add(at * BLOCK) as *const __m256i);
                    if let Some(signs) = signs {
                        xv = _mm256_sign_epi8(xv, signs);
                    }
                    $dot4(weights, xv)
                })
            }
        };
    }

    mod avx2 {
        use super::*;
        tile_kernel!(tile, "avx2,fma,f16c", dot4_avx2);
    }
    mod vnni {
        use super::*;
        tile_kernel!(tile, "avx2,fma,f16c,avx512vnni,avx512vl", dot4_vnni);
    }
    pub(super) use avx2::tile as tile_avx2;
    pub(super) use vnni::tile as tile_vnni;

    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn dot4_avx2(unsigned: __m256i, signed: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(unsigned, signed), _mm256_set1_epi16(1))
    }

    #[inline]
    #[target_feature(enable = "avx512vnni,avx512vl")]
    unsafe fn dot4_vnni(unsigned: __m256i, signed: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), unsigned, signed)
    }

    /// 16 bytes of nibbles at `at` as 32 bytes in element order (low nibbles first).
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn nibbles(at: *const u8) -> __m256i {
        let packed = _mm_loadu_si128(at as *const __m128i);
        let mask = _mm_set1_epi8(0x0f);
        let low = _mm_and_si128(packed, mask);
        let high = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
        _mm256_set_m128i(high, low)
    }

    /// The f16 bit patterns in the low 16 bits of each i32 lane (the rest zero) as f32 lanes.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn f16_lanes(bits: __m256i) -> __m256 {
        // Lanes 0-3 and 4-7 packed into the low quadword of each half, then the halves joined.
        let packed = _mm256_packus_epi32(bits, bits);
        let ordered = _mm256_permute4x64_epi64(packed, 0b00_00_10_00);
        _mm256_cvtph_ps(_mm256_castsi256_si128(ordered))
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn horizontal_sum(v: __m256) -> f32 {
        let quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
        _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::quantise;
    use crate::quant::tests::random;

    const FORMATS: [QuantFormat; 3] = [QuantFormat::Q4_0, QuantFormat::Q4_1, QuantFormat::Q8_0];

    fn product(isa: Isa, x: &QuantisedRows, w: &QuantMatrix, rows: usize) -> Vec<f32> {
        let mut y = vec![f32::NAN; rows * w.rows()];
        // SAFETY: every isa passed here was detected; y holds rows × w.rows() floats.
        unsafe { columns(isa, x, w, y.as_mut_ptr(), w.rows(), 0, w.rows()) };
        y
    }

    fn isas() -> Vec<Isa> {
        let mut isas = vec![Isa::Portable];
        match detected_isa() {
            Isa::Vnni => isas.extend([Isa::Avx2, Isa::Vnni]),
            Isa::Avx2 => isas.push(Isa::Avx2),
            Isa::Portable => {}
        }
        isas
    }

    /// Every instruction set gives the reference's bits, for every row count up to the largest
    /// verified tree and past the kernels' blocks (64 weight rows, 4 activation rows).
    #[test]
    fn every_instruction_set_and_row_count_gives_the_same_bits() {
        // 3 blocks per row (one partial group of eight) and 11 (a whole group and a partial one).
        for (format, cols) in FORMATS.into_iter().flat_map(|f| [(f, 96), (f, 352)]) {
            let out = 131;
            let w = quantise(format, &random(out * cols, 1), out, cols);
            let rows = 65;
            let xs = random(rows * cols, 2);
            let all = QuantisedRows::new(&xs, cols);
            let reference: Vec<f32> = (0..rows)
                .flat_map(|r| (0..out).map(move |c| (r, c)))
                .map(|(r, c)| reference_dot(&w, c, &all, r))
                .collect();
            for isa in isas() {
                assert_eq!(
                    product(isa, &all, &w, rows),
                    reference,
                    "{format:?} {isa:?}, {cols} columns"
                );
                for count in [1, 2, 3, 5, 17] {
                    let some = QuantisedRows::new(&xs[..count * cols], cols);
                    assert_eq!(
                        product(isa, &some, &w, count),
                        reference[..count * out],
                        "{format:?} {isa:?} {count} rows, {cols} columns"
                    );
                }
            }
        }
    }

    /// Against f32 products with the dequantised weights: the activations' 8-bit rounding is the
    /// only difference, well under 1 % of the output's scale.
    #[test]
    fn products_match_the_dequantised_weights_within_activation_rounding() {
        for format in FORMATS {
            let (out, cols, rows) = (40, 576, 3);
            let w = quantise(format, &random(out * cols, 3), out, cols);
            let xs = random(rows * cols, 4);
            let got = product(detected_isa(), &QuantisedRows::new(&xs, cols), &w, rows);
            let mut dense = vec![0f32; cols];
            let mut worst = 0f32;
            let mut scale = 0f32;
            for c in 0..out {
                w.dequantise_row(c, &mut dense);
                for r in 0..rows {
                    let exact: f32 = dense.iter().zip(&xs[r * cols..]).map(|(a, b)| a * b).sum();
                    worst = worst.max((got[r * out + c] - exact).abs());
                    scale = scale.max(exact.abs());
                }
            }
            assert!(worst < 0.01 * scale, "{format:?}: {worst} of {scale}");
        }
    }

    #[test]
    fn activation_blocks_of_zeros_quantise_to_zero() {
        let rows = QuantisedRows::new(&[0.0; 64], 64);
        assert!(rows.q.iter().all(|&q| q == 0));
        assert!(rows.d.iter().all(|&d| d == 0.0));
    }
}
