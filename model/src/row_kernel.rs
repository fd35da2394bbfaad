//! `y = x Wᵀ` for a few rows of `x`, streaming every weight row once: the product that decoding
//! (1 row) and tree verification (2…64 rows) run on every layer.
//!
//! The `gemm` crate packs the weight into panels before multiplying when `x` has more than one
//! row; with a few rows that copy costs as much as the product, so one extra token doubled the
//! time of a forward (SmolLM2 on 2 cores: 20.5 ms for 1 token, 49.4 ms for 2). This kernel reads
//! each weight row straight from the tensor and multiplies it with every row of `x` while it is in
//! L1, so a forward over a handful of tokens costs about what one does.
//!
//! Every output `y[r][o]` is computed by the same sequence of operations (8-lane FMAs over the
//! input features in order, a fixed horizontal sum, then the tail in order), whatever the number
//! of rows or how the output features are split between threads. A token's logits are therefore
//! bit-for-bit the same whether it is decoded alone or verified inside a tree, as far as the
//! linear layers go. Weights are f32 or bf16 ([`Element`]); bf16 weights are widened to f32
//! exactly as they are loaded, so both run the same f32 arithmetic.

/// Whether this CPU runs the kernel (x86-64 with AVX2 and FMA, and F16C, which every AVX2 CPU
/// has, for 16-bit KV caches); elsewhere `gemm` serves.
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Shapes of one product: `x [rows, in_features]` and `w [.., in_features]`, both row-major and
/// contiguous; `y` has `y_stride` floats per row.
#[derive(Clone, Copy)]
pub struct Product {
    pub rows: usize,
    pub in_features: usize,
    pub y_stride: usize,
}

/// An element type the row kernels read, 8 at a time into f32 lanes or one as an f32, each
/// widened exactly: weights (f32, bf16) and KV caches (f32, f16, bf16).
pub trait Element: Copy {
    /// # Safety
    /// `at..at + 8` must be in bounds of `row`; AVX2 must be available.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(row: *const Self, at: usize) -> std::arch::x86_64::__m256;
    /// # Safety
    /// `at` must be in bounds of `row`.
    unsafe fn load1(row: *const Self, at: usize) -> f32;
}

impl Element for f32 {
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(row: *const Self, at: usize) -> std::arch::x86_64::__m256 {
        std::arch::x86_64::_mm256_loadu_ps(row.add(at))
    }
    #[inline(always)]
    unsafe fn load1(row: *const Self, at: usize) -> f32 {
        *row.add(at)
    }
}

/// A bf16 value's bits: the upper half of the f32 it widens to exactly.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub struct Bf16(pub u16);

impl Element for Bf16 {
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(row: *const Self, at: usize) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        let halves = _mm_loadu_si128(row.add(at) as *const __m128i);
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16))
    }
    #[inline(always)]
    unsafe fn load1(row: *const Self, at: usize) -> f32 {
        f32::from_bits(u32::from((*row.add(at)).0) << 16)
    }
}

/// An IEEE half-precision value's bits (a 16-bit KV cache). Reading it 8 at a time takes F16C,
/// which every CPU with AVX2 has ([`available`] checks).
#[derive(Clone, Copy)]
#[repr(transparent)]
pub struct F16(pub u16);

impl Element for F16 {
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(row: *const Self, at: usize) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        _mm256_cvtph_ps(_mm_loadu_si128(row.add(at) as *const __m128i))
    }
    #[inline(always)]
    unsafe fn load1(row: *const Self, at: usize) -> f32 {
        half::f16::from_bits((*row.add(at)).0).to_f32()
    }
}

/// Computes columns `first..first + len` of `y = x wᵀ`.
///
/// # Safety
/// [`available`] must be true; `x` must hold `rows × in_features` floats, `w` at least
/// `(first + len) × in_features` elements, and `y` `rows × y_stride` floats with
/// `first + len ≤ y_stride`; no other thread may write those columns of `y` meanwhile.
#[cfg(target_arch = "x86_64")]
pub unsafe fn columns<W: Element>(
    x: *const f32,
    w: *const W,
    y: *mut f32,
    product: Product,
    first: usize,
    len: usize,
) {
    // Weight rows one at a time in memory order: a single sequential stream, which the hardware
    // prefetcher follows best (tiles over 3 or 4 weight rows at once read at half the speed with
    // one row of `x`). A block of weight rows stays in L2 while every few rows of `x` (kept in L1)
    // pass over it.
    let end = first + len;
    let mut block = first;
    while block < end {
        let block_end = (block + COLUMN_BLOCK).min(end);
        let mut rows = 0;
        while rows < product.rows {
            let rows_end = (rows + ROW_BLOCK).min(product.rows);
            for column in block..block_end {
                let mut row = rows;
                while row < rows_end {
                    let tile = Tile { row, column };
                    row += match rows_end - row {
                        1 => tile.run::<W, 1>(x, w, y, product),
                        _ => tile.run::<W, 2>(x, w, y, product),
                    };
                }
            }
            rows = rows_end;
        }
        block = block_end;
    }
}

/// Weight rows per block: 64 rows of SmolLM2's 576 features are 147 KB, well inside L2.
const COLUMN_BLOCK: usize = 64;
/// Rows of `x` per pass over a block: more stop fitting in L1 beside the weight stream (measured:
/// 8 rows at once ran at a third of the speed per row of 4).
const ROW_BLOCK: usize = 4;
/// Independent accumulators per output, so that consecutive FMAs do not wait on each other.
const CHAINS: usize = 4;

/// The outputs of weight row `column` and rows `row..row + R` of `x`.
#[derive(Clone, Copy)]
struct Tile {
    row: usize,
    column: usize,
}

#[cfg(target_arch = "x86_64")]
impl Tile {
    /// Computes the tile's outputs and returns `R`, the rows done.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run<W: Element, const R: usize>(
        self,
        x: *const f32,
        w: *const W,
        y: *mut f32,
        product: Product,
    ) -> usize {
        use std::arch::x86_64::*;
        let k = product.in_features;
        let w_row = w.add(self.column * k);
        let mut x_rows = [x; R];
        for (r, x_row) in x_rows.iter_mut().enumerate() {
            *x_row = x.add((self.row + r) * k);
        }
        let mut acc = [[_mm256_setzero_ps(); CHAINS]; R];
        // Chunk `i` of 8 features always goes to chain `i % CHAINS`, whatever R is. The chain
        // index must be a constant for the accumulators to stay in registers.
        let full = k / 8 * 8;
        let mut at = 0;
        while at + CHAINS * 8 <= full {
            for chain in 0..CHAINS {
                step(&mut acc, chain, &x_rows, w_row, at + chain * 8);
            }
            at += CHAINS * 8;
        }
        for chain in 0..CHAINS {
            if at < full {
                step(&mut acc, chain, &x_rows, w_row, at);
                at += 8;
            }
        }
        for r in 0..R {
            let [a, b, c, d] = acc[r];
            let mut sum = horizontal_sum(_mm256_add_ps(_mm256_add_ps(a, b), _mm256_add_ps(c, d)));
            for j in full..k {
                sum = (*x_rows[r].add(j)).mul_add(W::load1(w_row, j), sum);
            }
            *y.add((self.row + r) * product.y_stride + self.column) = sum;
        }
        R
    }
}

/// Adds features `at..at + 8` of every `x` row times the weight row to chain `chain`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn step<W: Element, const R: usize>(
    acc: &mut [[std::arch::x86_64::__m256; CHAINS]; R],
    chain: usize,
    x_rows: &[*const f32; R],
    w_row: *const W,
    at: usize,
) {
    use std::arch::x86_64::*;
    let wv = W::load8(w_row, at);
    for r in 0..R {
        let xv = _mm256_loadu_ps(x_rows[r].add(at));
        acc[r][chain] = _mm256_fmadd_ps(xv, wv, acc[r][chain]);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn horizontal_sum(v: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
    _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)))
}
