//! `y = x Wᵀ` for a [`QuantMatrix`] `W`, reading its blocks as stored.
//!
//! Activations are quantised first, per row and per 32-value block, to 8-bit integers with an f32
//! scale (`d = max|x| / 127`, `q = round(x / d)`): llama.cpp's `Q8` activation format, but with
//! an f32 rather than f16 scale. Each block product is then an exact integer dot product (four
//! adjacent byte products summed into each of 8 i32 lanes), scaled by `d_w · d_x` and accumulated
//! in f32 lanes; `Q4_1`'s minimum adds `m_w · d_x Σq_x`, eight blocks per FMA, in a second set
//! of lanes. The result
//! differs from the f32 product of the dequantised weights by the activations' rounding (a
//! relative error of about 0.3 % per block, which averages out over a row; the parity tests
//! state the bound).
//!
//! Every output `y[r][o]` runs the same operations in the same order whatever the number of rows
//! beside it, the thread split, or the instruction set: the integer lanes are exact, so AVX2's
//! `maddubs`+`madd` and AVX-512 VNNI's `dpbusd` give the same integers, and the float sequence
//! (per block one FMA per lane, a fixed horizontal sum, the minimum's lanes summed and added last)
//! is fixed. The
//! portable fallback [`reference_dot`] replays that sequence lane by lane and is bit-identical, which
//! the tests check.

use crate::quant::{f16_at, QuantFormat, QuantMatrix, BLOCK};

/// Lanes of the f32 accumulator and the integer sums: 8 (one AVX2 register).
const LANES: usize = 8;

/// Activation rows quantised to 8 bits per 32-value block.
pub struct QuantisedRows {
    cols: usize,
    /// `rows × cols` quantised values.
    q: Vec<i8>,
    /// Per block: the scale `d`.
    d: Vec<f32>,
    /// Per block: `d · Σq`, what a weight minimum (`Q4_1`) multiplies; each row padded with
    /// zeros to a whole number of [`LANES`] blocks, so that eight blocks load as one vector.
    sum: Vec<f32>,
}

impl QuantisedRows {
    /// Quantises `x`, `rows × cols` floats (`cols` a multiple of 32).
    pub fn new(x: &[f32], cols: usize) -> Self {
        assert!(cols.is_multiple_of(BLOCK), "rows of whole blocks");
        let blocks = x.len() / BLOCK;
        let sum_stride = sum_stride(cols / BLOCK);
        let mut rows = Self {
            cols,
            q: vec![0; x.len()],
            d: Vec::with_capacity(blocks),
            sum: vec![0.0; blocks / (cols / BLOCK).max(1) * sum_stride],
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
            rows.d.push(d);
            let (row, block) = (at / (cols / BLOCK), at % (cols / BLOCK));
            rows.sum[row * sum_stride + block] = d * total as f32;
        }
        rows
    }

    fn blocks_per_row(&self) -> usize {
        self.cols / BLOCK
    }
}

/// Entries per row of [`QuantisedRows::sum`]: the blocks rounded up to whole vectors.
fn sum_stride(blocks: usize) -> usize {
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
    let mut lanes = [0f32; LANES];
    let mut minimum_lanes = [0f32; LANES];
    let mut minimums = [0f32; LANES];
    let blocks = x.blocks_per_row();
    for b in 0..blocks {
        let block = &w_row[b * block_bytes..(b + 1) * block_bytes];
        let weights = block_values(format, block);
        let at = row * x.blocks_per_row() + b;
        let xq = &x.q[at * BLOCK..(at + 1) * BLOCK];
        let scale = f16_at(block, 0) * x.d[at];
        for (lane, acc) in lanes.iter_mut().enumerate() {
            let ints: i32 = (lane * 4..lane * 4 + 4)
                .map(|e| i32::from(weights[e]) * i32::from(xq[e]))
                .sum();
            *acc = (ints as f32).mul_add(scale, *acc);
        }
        if format == QuantFormat::Q4_1 {
            minimums[b % LANES] = f16_at(block, 2);
            if b % LANES == LANES - 1 || b + 1 == blocks {
                let sums = &x.sum[row * sum_stride(blocks) + b / LANES * LANES..];
                for (lane, acc) in minimum_lanes.iter_mut().enumerate() {
                    *acc = minimums[lane].mul_add(sums[lane], *acc);
                }
                minimums = [0.0; LANES];
            }
        }
    }
    horizontal_sum(lanes) + horizontal_sum(minimum_lanes)
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

    use super::{sum_stride, QuantisedRows, Tile, BLOCK, LANES};
    use crate::quant::{QuantFormat, QuantMatrix};

    /// The kernel for one instruction set: `$dot4` sums four adjacent products of unsigned and
    /// signed bytes into each i32 lane.
    macro_rules! tile_kernel {
        ($name:ident, $features:literal, $dot4:ident) => {
            #[target_feature(enable = $features)]
            pub(super) unsafe fn $name<const FORMAT: u8, const R: usize>(
                tile: Tile,
                x: &QuantisedRows,
                w: &QuantMatrix,
            ) -> [f32; R] {
                // A constant in each instance, so that every format gets its own loop.
                let format = QuantFormat::from_code(FORMAT);
                let block_bytes = format.block_bytes();
                let w_row = w.data().as_ptr().add(tile.column * w.row_bytes());
                let blocks = x.blocks_per_row();
                let x_first = tile.row * blocks;
                let mut acc = [_mm256_setzero_ps(); R];
                let mut minimum_lanes = [_mm256_setzero_ps(); R];
                // The minimums of the current run of 8 blocks (zeros past the last block).
                let mut minimums = [0f32; LANES];
                let sum_stride = sum_stride(blocks);
                for b in 0..blocks {
                    let block = w_row.add(b * block_bytes);
                    let d_w = f16(block);
                    // Unsigned weight bytes and, for signed formats, the sign moved onto x.
                    let (weights, signs) = match format {
                        QuantFormat::Q4_1 => (nibbles(block.add(4)), None),
                        QuantFormat::Q4_0 => {
                            let signed =
                                _mm256_sub_epi8(nibbles(block.add(2)), _mm256_set1_epi8(8));
                            (_mm256_sign_epi8(signed, signed), Some(signed))
                        }
                        QuantFormat::Q8_0 => {
                            let signed = _mm256_loadu_si256(block.add(2) as *const __m256i);
                            (_mm256_sign_epi8(signed, signed), Some(signed))
                        }
                    };
                    for r in 0..R {
                        let at = x_first + r * blocks + b;
                        let mut xv =
                            _mm256_loadu_si256(x.q.as_ptr().add(at * BLOCK) as *const __m256i);
                        if let Some(signs) = signs {
                            xv = _mm256_sign_epi8(xv, signs);
                        }
                        let ints = $dot4(weights, xv);
                        let scale = _mm256_set1_ps(d_w * *x.d.get_unchecked(at));
                        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ints), scale, acc[r]);
                    }
                    if format == QuantFormat::Q4_1 {
                        minimums[b % LANES] = f16(block.add(2));
                        if b % LANES == LANES - 1 || b + 1 == blocks {
                            let m = _mm256_loadu_ps(minimums.as_ptr());
                            for r in 0..R {
                                let at = (tile.row + r) * sum_stride + b / LANES * LANES;
                                let sums = _mm256_loadu_ps(x.sum.as_ptr().add(at));
                                minimum_lanes[r] = _mm256_fmadd_ps(m, sums, minimum_lanes[r]);
                            }
                            minimums = [0.0; LANES];
                        }
                    }
                }
                std::array::from_fn(|r| horizontal_sum(acc[r]) + horizontal_sum(minimum_lanes[r]))
            }
        };
    }

    tile_kernel!(tile_avx2, "avx2,fma,f16c", dot4_avx2);
    tile_kernel!(tile_vnni, "avx2,fma,f16c,avx512vnni,avx512vl", dot4_vnni);

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

    #[inline]
    #[target_feature(enable = "f16c")]
    unsafe fn f16(at: *const u8) -> f32 {
        let bits = u16::from_le_bytes([*at, *at.add(1)]);
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
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
        for format in FORMATS {
            let (out, cols) = (131, 96);
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
                    "{format:?} {isa:?}"
                );
                for count in [1, 2, 3, 5, 17] {
                    let some = QuantisedRows::new(&xs[..count * cols], cols);
                    assert_eq!(
                        product(isa, &some, &w, count),
                        reference[..count * out],
                        "{format:?} {isa:?} {count} rows"
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
        assert_eq!(rows.d, [0.0, 0.0]);
    }
}
