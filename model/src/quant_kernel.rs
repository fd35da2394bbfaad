//! `y = x Wᵀ` for quantised weights, with the blocks repacked once at load ([`PackedMatrix`]) so
//! that one vector holds eight output features.
//!
//! Activations are quantised first, per row and per 32-value block, to 8-bit integers with an f32
//! scale (`d = max|x| / 127`, `q = round(x / d)`): llama.cpp's `Q8` activation format, but with
//! an f32 rather than f16 scale. The weights of eight consecutive output features are interleaved
//! block by block: lane `j` of a 32-byte load holds four consecutive quants of feature `j`, so a
//! broadcast of four activation quants and one `dpbusd` (or `maddubs`+`madd`) advance eight dot
//! products at once, and after eight such steps lane `j` holds block `b`'s exact integer product
//! for feature `j` — no horizontal reduction, and the unpacked weights serve every activation row
//! of a tile. Each block then costs one FMA per lane (`Σq · d_w·d_x`), plus one for the minimum
//! of `Q4_1` and `Q4_K` (`m_w · d_x Σq_x`, on its own accumulator; `Q4_K`'s `d_w` and `m_w` are
//! the products of its super-block's f16 scales and the block's 6-bit integers, formed here as
//! they are everywhere else). `Q6_K`'s two half scales multiply the halves' integer sums, each
//! less its offset, before that (`s₀(Σ₀ − 32Σx₀) + s₁(Σ₁ − 32Σx₁)`, still exact). The result
//! differs from the f32 product of the dequantised weights by the activations' rounding (about
//! 0.3 % per block, averaging out over a row; the parity tests state the bound).
//!
//! Every output `y[r][o]` runs the same operations in the same order whatever the number of rows
//! beside it, the thread split, or the instruction set: the integer sums are exact, so AVX2's
//! `maddubs`+`madd` and AVX-512 VNNI's `dpbusd`, in any grouping, give the same integers, and the
//! float sequence (even blocks into one accumulator, odd into another, the minimum's terms into a
//! third, then `(even + odd) + minimum`) is fixed. The portable fallback [`reference_dot`]
//! replays that sequence and is bit-identical, which the tests check.
//!
//! Where the CPU has AVX-512 ([`Isa::Vnni512`]), a tile takes two neighbouring octets into one
//! 512-bit register, each half loaded and unpacked as alone: one broadcast of four activation
//! quants, one `dpbusd` and one set of float fix-ups then serve sixteen features, and every lane
//! runs the operations it runs on 256 bits, so the bits stay the same. It is taken only where
//! 512-bit registers multiply faster than 256-bit ones ([`kernel_isa`]; not on AMD Zen 4).
//!
//! Why interleave: the previous layout (blocks as GGUF stores them, one feature per vector) needed
//! a tree of horizontal adds per block and row to bring eight blocks' sums into eight lanes; with
//! one row that made the kernel compute-bound at about 2.5 times the instructions per block, and
//! every extra row of a verified tree cost almost as much as the first.

use std::sync::Arc;

use crate::quant::high_bits_field;
use crate::quant::{block_minimum, block_quant, block_scale, dequantise_block, half_scales};
use crate::quant::{QuantFormat, QuantMatrix, BLOCK};

/// Output features per interleaved group: the f32 lanes of one AVX2 register.
const LANES: usize = 8;

/// Activation quants one `dpbusd` lane takes: four bytes, broadcast to every lane.
const GROUP: usize = 4;

/// Four-quant groups per block: the vector steps of one block product.
const STEPS: usize = BLOCK / GROUP;

/// A quantised `[rows, cols]` matrix (one row per output feature, as [`QuantMatrix`]) with the
/// blocks of every eight rows interleaved. Per eight rows ("octet") and block, in order: each
/// header field of the format ([`QuantFormat::header_fields`]: scale, minimum, half scales) for
/// the eight rows; then the quants. 4-bit formats: four 32-byte chunks, chunk `k`'s lane `j`
/// (bytes `4j..4j+4`) holding row `j`'s elements `8k..8k+4` in the low nibbles and `8k+4..8k+8`
/// in the high ones; signed bytes: eight chunks, chunk `g`'s lane `j` holding elements
/// `4g..4g+4`. The fields a super-block's blocks share ([`QuantFormat::shared_fields`]: `Q4_K`'s
/// `d` and `dmin`) come once per octet and super-block, before its eight blocks. The bytes are as
/// many as the [`QuantMatrix`]'s (less the repeated shared fields), plus zero rows up to a whole
/// octet. Cloning shares the bytes.
#[derive(Clone)]
pub struct PackedMatrix {
    format: QuantFormat,
    rows: usize,
    cols: usize,
    data: Arc<[u8]>,
}

impl std::fmt::Debug for PackedMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PackedMatrix({} [{}, {}])",
            self.format.name(),
            self.rows,
            self.cols
        )
    }
}

impl PackedMatrix {
    /// Interleaves `blocks`.
    pub fn new(blocks: &QuantMatrix) -> Self {
        let format = blocks.format();
        let (rows, cols) = (blocks.rows(), blocks.cols());
        let per_row = cols / BLOCK;
        let octets = rows.div_ceil(LANES);
        let mut data = vec![0u8; octets * per_row / unit_blocks(format) * unit_bytes(format)];
        for (row, source) in blocks.data().chunks_exact(blocks.row_bytes()).enumerate() {
            for (b, block) in source.chunks_exact(format.block_bytes()).enumerate() {
                let (shared_at, at) = block_places(format, per_row, row / LANES, b);
                let (before, from) = data.split_at_mut(at);
                pack_block(
                    format,
                    block,
                    row % LANES,
                    &mut before[shared_at..][..shared_octet_bytes(format)],
                    &mut from[..octet_bytes(format)],
                );
            }
        }
        Self {
            format,
            rows,
            cols,
            data: data.into(),
        }
    }

    /// The blocks in [`QuantMatrix`]'s layout again (for joins and dense copies).
    pub fn unpacked(&self) -> QuantMatrix {
        let mut data = Vec::with_capacity(self.rows * self.row_bytes());
        for row in 0..self.rows {
            for b in 0..self.cols / BLOCK {
                data.extend_from_slice(&self.block(row, b));
            }
        }
        QuantMatrix::new(self.format, self.rows, self.cols, data.into())
            .expect("the sizes of a packed matrix")
    }

    pub fn format(&self) -> QuantFormat {
        self.format
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes the kernels stream (the [`QuantMatrix`]'s less repeated shared fields, plus padding
    /// rows).
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    /// The bytes the kernels stream, in the interleaved layout.
    pub fn data(&self) -> &[u8] {
        &self.data
    }

    fn row_bytes(&self) -> usize {
        self.cols / BLOCK * self.format.block_bytes()
    }

    /// Block `b` of row `row` in [`QuantMatrix`]'s layout.
    fn block(&self, row: usize, b: usize) -> Vec<u8> {
        let format = self.format;
        let (shared_at, at) = block_places(format, self.cols / BLOCK, row / LANES, b);
        let shared = &self.data[shared_at..][..shared_octet_bytes(format)];
        unpack_block(
            format,
            shared,
            &self.data[at..][..octet_bytes(format)],
            row % LANES,
        )
    }

    /// Row `row`'s values into `out` (`cols` floats).
    pub fn dequantise_row(&self, row: usize, out: &mut [f32]) {
        for (b, values) in out.chunks_exact_mut(BLOCK).enumerate() {
            dequantise_block(self.format, &self.block(row, b), values);
        }
    }
}

/// A matrix whose consecutive row ranges are [`PackedMatrix`]es of one width, perhaps in
/// different formats: a fused q/k/v or gate/up projection whose parts a GGUF stores in different
/// block types (`Q4_K` beside `Q6_K` in `Q4_K_M` files) stays quantised. Adjacent parts in one
/// format are joined, so that threads split one range. Cloning shares the bytes.
#[derive(Clone, Debug)]
pub struct StackedMatrix {
    /// Each part and its first row.
    parts: Vec<(usize, PackedMatrix)>,
    rows: usize,
    cols: usize,
}

impl StackedMatrix {
    /// `parts`' rows one after another, or `None` when there are none or their widths differ.
    pub fn new(parts: &[QuantMatrix]) -> Option<Self> {
        let cols = parts.first()?.cols();
        if parts.iter().any(|p| p.cols() != cols) {
            return None;
        }
        let mut stacked = Self {
            parts: Vec::new(),
            rows: 0,
            cols,
        };
        for run in parts.chunk_by(|a, b| a.format() == b.format()) {
            let joined = QuantMatrix::concat_rows(run)?;
            stacked
                .parts
                .push((stacked.rows, PackedMatrix::new(&joined)));
            stacked.rows += joined.rows();
        }
        Some(stacked)
    }

    /// Each part with its first row.
    pub fn parts(&self) -> impl Iterator<Item = (usize, &PackedMatrix)> {
        self.parts.iter().map(|(first, part)| (*first, part))
    }

    /// The parts in [`QuantMatrix`]'s layout, in order.
    pub fn unpacked(&self) -> Vec<QuantMatrix> {
        self.parts().map(|(_, part)| part.unpacked()).collect()
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes the kernels stream.
    pub fn bytes(&self) -> usize {
        self.parts().map(|(_, part)| part.bytes()).sum()
    }

    /// Row `row`'s values into `out` (`cols` floats).
    pub fn dequantise_row(&self, row: usize, out: &mut [f32]) {
        let (first, part) = self
            .parts()
            .take_while(|(first, _)| *first <= row)
            .last()
            .expect("a row of the matrix");
        part.dequantise_row(row - first, out);
    }

    /// Every value, as a dense f32 `[rows, cols]` CPU tensor.
    pub fn dequantise(&self) -> tch::Tensor {
        let parts: Vec<tch::Tensor> = self
            .parts()
            .map(|(_, part)| {
                part.unpacked()
                    .dequantise(tch::Kind::Float, tch::Device::Cpu)
            })
            .collect();
        tch::Tensor::cat(&parts, 0)
    }
}

/// Bytes of one octet's block: eight blocks, without the fields their super-blocks share.
const fn octet_bytes(format: QuantFormat) -> usize {
    LANES * (format.block_bytes() - format.shared_bytes())
}

/// Bytes of the header fields before an octet's quants.
const fn scale_bytes(format: QuantFormat) -> usize {
    LANES * (format.header_bytes() - format.shared_bytes())
}

/// Bytes of the shared fields before an octet's super-block: eight super-blocks' (0 for formats
/// without).
const fn shared_octet_bytes(format: QuantFormat) -> usize {
    LANES * format.shared_bytes()
}

/// Where the first word of high bits ([`QuantFormat::high_bits`]) starts in an octet's block.
const fn high_words_at(format: QuantFormat) -> usize {
    LANES * (format.field_start(high_bits_field(format)) - format.shared_bytes())
}

/// Blocks per unit of the layout: a super-block for formats with shared fields, else a block.
const fn unit_blocks(format: QuantFormat) -> usize {
    format.row_multiple() / BLOCK
}

/// Bytes of one octet's unit: the shared fields, then each block.
const fn unit_bytes(format: QuantFormat) -> usize {
    shared_octet_bytes(format) + unit_blocks(format) * octet_bytes(format)
}

/// Where octet `octet`'s block `b` (of `per_row`) lives: the start of its unit (the shared
/// fields), and of its own bytes.
fn block_places(format: QuantFormat, per_row: usize, octet: usize, b: usize) -> (usize, usize) {
    let unit = unit_blocks(format);
    let shared_at = (octet * per_row / unit + b / unit) * unit_bytes(format);
    let at = shared_at + shared_octet_bytes(format) + b % unit * octet_bytes(format);
    (shared_at, at)
}

/// Where element `e` of lane `lane` lives in an octet's quants: byte, and for 4-bit formats
/// whether it is the high nibble.
fn quant_place(format: QuantFormat, lane: usize, e: usize) -> (usize, bool) {
    if format.nibbles() {
        let (chunk, within) = (e / 8, e % 8);
        (chunk * 32 + lane * GROUP + within % GROUP, within >= GROUP)
    } else {
        (e / GROUP * 32 + lane * GROUP + e % GROUP, false)
    }
}

/// Where a header field lives.
struct HeaderPlace {
    /// Its first byte in a block,
    in_block: usize,
    /// whether it is one of the super-block's shared fields,
    shared: bool,
    /// its first byte in the octet's shared fields or block (eight lanes' copies),
    in_octet: usize,
    /// and its bytes per lane.
    width: usize,
}

/// Every header field's place, in order.
fn header_places(format: QuantFormat) -> impl Iterator<Item = HeaderPlace> {
    let shared = format.shared_fields();
    (0..format.header_fields().len()).map(move |field| {
        let in_block = format.field_start(field);
        let own_start = if field < shared {
            0
        } else {
            format.shared_bytes()
        };
        HeaderPlace {
            in_block,
            shared: field < shared,
            in_octet: (in_block - own_start) * LANES,
            width: format.header_fields()[field],
        }
    })
}

/// Where bit `k` of the high bits of a word's element `e` (`bits` per element: `Q5_0`'s one,
/// `Q6_K`'s two) sits in the kernel's copy of the 32-bit word: bit `8i + bits·s + k` for element
/// `4s + i`, so that one shift and mask put step `s`'s bits at bit 4 of the four bytes that hold
/// their nibbles.
const fn kernel_high_bit(bits: usize, e: usize, k: usize) -> usize {
    8 * (e % GROUP) + bits * (e / GROUP) + k
}

/// A word of high bits (bits `bits·e..bits·(e + 1)` for element `e`) in the kernel's order, or
/// back with `inverse`.
fn reorder_high_bits(bits: usize, word: [u8; 4], inverse: bool) -> [u8; 4] {
    let word = u32::from_le_bytes(word);
    let places = (0..32 / bits).flat_map(|e| (0..bits).map(move |k| (e, k)));
    let moved = places.fold(0u32, |out, (e, k)| {
        let (stored, kernel) = (bits * e + k, kernel_high_bit(bits, e, k));
        let (from, to) = if inverse {
            (kernel, stored)
        } else {
            (stored, kernel)
        };
        out | ((word >> from) & 1) << to
    });
    moved.to_le_bytes()
}

/// Header field `field` as packed for the kernels, or back with `inverse`.
fn reorder_field(format: QuantFormat, field: usize, bytes: &[u8], inverse: bool, out: &mut [u8]) {
    if format.high_bits() > 0 && field >= high_bits_field(format) {
        let word = bytes.try_into().expect("a 32-bit word");
        out.copy_from_slice(&reorder_high_bits(format.high_bits(), word, inverse))
    } else {
        out.copy_from_slice(bytes)
    }
}

/// Writes `block` as lane `lane` of `octet` (and of its unit's `shared` fields).
fn pack_block(format: QuantFormat, block: &[u8], lane: usize, shared: &mut [u8], octet: &mut [u8]) {
    for (field, place) in header_places(format).enumerate() {
        let bytes = &block[place.in_block..][..place.width];
        let region = if place.shared {
            &mut *shared
        } else {
            &mut *octet
        };
        let out = &mut region[place.in_octet + lane * place.width..][..place.width];
        reorder_field(format, field, bytes, false, out);
    }
    let quants = &mut octet[scale_bytes(format)..];
    for e in 0..BLOCK {
        let (at, high) = quant_place(format, lane, e);
        let mut quant = block_quant(format, block, e);
        if format.nibbles() {
            quant &= 0x0f;
        }
        quants[at] |= quant << if high { 4 } else { 0 };
    }
}

/// Lane `lane` of `octet` (with its unit's `shared` fields) as a block.
fn unpack_block(format: QuantFormat, shared: &[u8], octet: &[u8], lane: usize) -> Vec<u8> {
    let mut block = vec![0u8; format.block_bytes()];
    for (field, place) in header_places(format).enumerate() {
        let region = if place.shared { shared } else { octet };
        let bytes = &region[place.in_octet + lane * place.width..][..place.width];
        let out = &mut block[place.in_block..][..place.width];
        reorder_field(format, field, bytes, true, out);
    }
    let quants = &octet[scale_bytes(format)..];
    let block_quants = &mut block[format.header_bytes()..];
    for e in 0..BLOCK {
        let (at, high) = quant_place(format, lane, e);
        let quant = if high { quants[at] >> 4 } else { quants[at] };
        if format.nibbles() {
            block_quants[e % (BLOCK / 2)] |= (quant & 0x0f) << (4 * (e / (BLOCK / 2)));
        } else {
            block_quants[e] = quant;
        }
    }
    block
}

/// Activation rows quantised to 8 bits per 32-value block.
pub struct QuantisedRows {
    cols: usize,
    /// `rows × cols` quantised values.
    q: Vec<i8>,
    /// Per row and block: the scale `d`,
    d: Vec<f32>,
    /// `d · Σq`, what a weight minimum (`Q4_1`) multiplies,
    sum: Vec<f32>,
    /// `Σq`, what an offset of the unsigned weights (`Q4_0`'s 8, `Q5_0`'s 16) multiplies,
    sum_q: Vec<i32>,
    /// and the first half's (`Q6_K`'s offset meets each half's own scale).
    half_sum_q: Vec<i32>,
}

impl QuantisedRows {
    /// Quantises `x`, `rows × cols` floats (`cols` a multiple of 32), eight values a step where
    /// the CPU has AVX2 (the same values as one at a time: see [`Self::quantise_block`]).
    pub fn new(x: &[f32], cols: usize) -> Self {
        Self::quantised_with(x, cols, kernel_isa())
    }

    fn quantised_with(x: &[f32], cols: usize, isa: Isa) -> Self {
        assert!(cols.is_multiple_of(BLOCK), "rows of whole blocks");
        let blocks = x.len() / BLOCK;
        let mut rows = Self {
            cols,
            q: vec![0; x.len()],
            d: Vec::with_capacity(blocks),
            sum: Vec::with_capacity(blocks),
            sum_q: Vec::with_capacity(blocks),
            half_sum_q: Vec::with_capacity(blocks),
        };
        for (values, q) in x.chunks_exact(BLOCK).zip(rows.q.chunks_exact_mut(BLOCK)) {
            let values: &[f32; BLOCK] = values.try_into().expect("a whole block");
            let q: &mut [i8; BLOCK] = q.try_into().expect("a whole block");
            let (d, total, first_half) = match isa {
                // SAFETY: `isa` is the detected one, which has AVX2 unless portable.
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 | Isa::Vnni | Isa::Vnni512 => unsafe { simd::quantise_block(values, q) },
                _ => Self::quantise_block(values, q),
            };
            rows.d.push(d);
            rows.sum.push(d * total as f32);
            rows.sum_q.push(total);
            rows.half_sum_q.push(first_half);
        }
        rows
    }

    /// One block: `d = max|x| / 127`, `q = round(x / d)` (as `x · (1/d)`, halves away from
    /// zero), and the block's and its first half's `Σq`.
    fn quantise_block(values: &[f32; BLOCK], q: &mut [i8; BLOCK]) -> (f32, i32, i32) {
        let amax = values.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let inverse = if d != 0.0 { 1.0 / d } else { 0.0 };
        for (value, q) in values.iter().zip(q.iter_mut()) {
            *q = round_half_away(value * inverse) as i8;
        }
        let half_sum = |half: &[i8]| half.iter().map(|&q| i32::from(q)).sum::<i32>();
        let (first, second) = q.split_at(BLOCK / 2);
        (d, half_sum(first) + half_sum(second), half_sum(first))
    }

    /// Rows quantised.
    pub fn rows(&self) -> usize {
        self.q.len() / self.cols.max(1)
    }

    fn blocks_per_row(&self) -> usize {
        self.cols / BLOCK
    }
}

/// `y.round()` for `|y| < 2²³` (here at most 127) without libm's `roundf`, which the baseline
/// x86-64 target calls for every value: truncation is one instruction, and `y − trunc(y)` is
/// exact, so comparing it with ±½ rounds halves away from zero as `round` does.
#[inline(always)]
fn round_half_away(y: f32) -> i32 {
    let truncated = y as i32;
    let fraction = y - truncated as f32;
    truncated + i32::from(fraction >= 0.5) - i32::from(fraction <= -0.5)
}

/// The instruction set [`columns`] runs on, chosen once per process; each runs on every CPU
/// that runs the ones after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// Plain Rust, [`reference_dot`].
    Portable,
    /// AVX2 with FMA and F16C.
    Avx2,
    /// AVX-512 VNNI (`vpdpbusd` on 256-bit registers).
    Vnni,
    /// AVX-512 VNNI on 512-bit registers: two octets a tile wherever two lie side by side, one
    /// as [`Isa::Vnni`] elsewhere.
    Vnni512,
}

impl Isa {
    /// Whether this CPU runs `self`: its widest set or a lesser one.
    pub fn available(self) -> bool {
        self <= widest_isa()
    }

    /// Every set this CPU runs, least first.
    pub fn all_available() -> Vec<Isa> {
        [Isa::Portable, Isa::Avx2, Isa::Vnni, Isa::Vnni512]
            .into_iter()
            .filter(|isa| isa.available())
            .collect()
    }
}

/// The widest [`Isa`] this CPU has.
fn widest_isa() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 = is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c");
        if avx2 && is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl") {
            return match is_x86_feature_detected!("avx512f") {
                true => Isa::Vnni512,
                false => Isa::Vnni,
            };
        }
        if avx2 {
            return Isa::Avx2;
        }
    }
    Isa::Portable
}

/// How much faster 512-bit `vpdpbusd` must multiply than 256-bit for the kernels to take
/// [`Isa::Vnni512`]: where it is not, the wide tile's joins are pure cost.
const WIDE_GAIN: f64 = 1.3;

/// The [`Isa`] the kernels run, chosen once per process: the widest this CPU has, but 512-bit
/// registers only where they raise the measured int8 MAC rate by [`WIDE_GAIN`]. An Intel Xeon
/// with AMX measured 422 against 254 G MACs/s and takes them; AMD Zen 4 runs each 512-bit
/// operation as two halves (236 G both ways), and there the wide tile made 1–8 rows slower
/// (one thread, 30 × [1536 × 576]: Q4_1 one row 0.34 → 0.46 ms, Q8_0 0.65 → 1.47 ms). Every
/// set gives the same bits, so the choice moves only time.
pub fn kernel_isa() -> Isa {
    static CHOSEN: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
    *CHOSEN.get_or_init(|| match widest_isa() {
        Isa::Vnni512 if int8_mac_rate(Isa::Vnni512) < WIDE_GAIN * int8_mac_rate(Isa::Vnni) => {
            Isa::Vnni
        }
        isa => isa,
    })
}

/// Int8 multiply-accumulates per second one thread does with `isa`'s kernel instruction
/// (`vpdpbusd`, or `vpmaddubsw` + `vpmaddwd` + `vpaddd`) on its registers (256-bit, 512-bit for
/// [`Isa::Vnni512`]), every operand in a register: the compute roof of a few-row product (the other is [`crate::roof::read_rate`]).
/// Best of five runs of about a millisecond; 0 for the portable code, which has no such peak.
pub fn int8_mac_rate(isa: Isa) -> f64 {
    assert!(isa.available(), "{isa:?} is not available on this CPU");
    const ROUNDS: usize = 1 << 16;
    let best = |run: &dyn Fn()| {
        (0..5)
            .map(|_| {
                let start = std::time::Instant::now();
                run();
                start.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min)
    };
    let macs = (ROUNDS * simd::CHAINS * LANES * GROUP) as f64;
    match isa {
        // SAFETY: `isa` is available (asserted above). 512-bit registers hold twice the lanes.
        #[cfg(target_arch = "x86_64")]
        Isa::Vnni512 => 2.0 * macs / best(&|| unsafe { simd::dot4_rounds_vnni512(ROUNDS) }),
        #[cfg(target_arch = "x86_64")]
        Isa::Vnni => macs / best(&|| unsafe { simd::dot4_rounds_vnni(ROUNDS) }),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => macs / best(&|| unsafe { simd::dot4_rounds_avx2(ROUNDS) }),
        _ => 0.0,
    }
}

/// Octets per block of output features: a block of packed weights stays in L1/L2 while every
/// pass of activation rows goes over it.
const OCTET_BLOCK: usize = 8;

/// Activation rows one pass over an octet's unpacked block serves. Eight, one pass for the 5–8
/// rows of a small verified tree (`--example quant_kernel`, VNNI, 8 rows: Q4_0 2.35 → 2.02 ms,
/// Q4_1 2.40 → 2.10, Q5_0 2.78 → 2.27); four for the K types, whose per-block scales leave
/// too few registers for eight rows' sums (8 rows: Q4_K 2.32 → 2.75, Q6_K 3.55 → 4.30 ms), and
/// for rows longer than [`PASS_ACTIVATION_BYTES`] allows eight of.
fn pass_rows(format: QuantFormat, cols: usize) -> usize {
    match format {
        QuantFormat::Q4_K | QuantFormat::Q6_K => 4,
        _ if 8 * cols > PASS_ACTIVATION_BYTES => 4,
        _ => 8,
    }
}

/// The most bytes of quantised activations a pass of eight rows reads for every octet: each
/// octet reads them all again, and past this they and the octet's weights no longer stay in L1
/// together. One thread, AMD Zen 4, VNNI, 8 rows over SmolLM2's `ffn_down` (576 × 1536, 12 KiB
/// of activations), 30 layers: one pass of eight 2.06–2.42 ms, two of four 1.6–1.9 ms; over
/// 1536 × 576 (4.5 KiB) both ~1.6–1.7 ms.
const PASS_ACTIVATION_BYTES: usize = 8 * 1024;

/// Output features a part of a split should start at a multiple of: whole octets, so that two
/// threads never unpack the same weights.
pub const COLUMN_ALIGN: usize = LANES;

/// Computes columns `first..first + len` of `y = x wᵀ` (`y` row-major with `y_stride` floats per
/// row) on `isa`.
///
/// # Safety
/// `isa` must be available on this CPU; `y` must hold `rows × y_stride` floats with
/// `first + len ≤ min(y_stride, w.rows())`; no other thread may write those columns meanwhile.
pub unsafe fn columns(
    isa: Isa,
    x: &QuantisedRows,
    w: &PackedMatrix,
    y: *mut f32,
    y_stride: usize,
    first: usize,
    len: usize,
) {
    assert_eq!(x.cols, w.cols(), "activation and weight widths");
    let (end, rows) = (first + len, x.rows());
    let octets = first / LANES..end.div_ceil(LANES);
    let mut block = octets.start;
    while block < octets.end {
        let block_end = (block + OCTET_BLOCK).min(octets.end);
        let mut row = 0;
        while row < rows {
            let rows_end = (row + pass_rows(w.format(), w.cols())).min(rows);
            let mut octet = block;
            while octet < block_end {
                let tile = Tile { row, octet };
                let octets = match isa == Isa::Vnni512 && octet + 1 < block_end {
                    true => 2,
                    false => 1,
                };
                let lanes = (octet * LANES).max(first)..(octet * LANES + octets * LANES).min(end);
                /// The tile's `R` rows on the register width of `octets`, stored.
                macro_rules! store {
                    ($r:literal) => {
                        match octets {
                            2 => tile.store(tile.run_wide::<$r>(x, w), y, y_stride, lanes),
                            _ => tile.store(tile.run::<$r>(isa, x, w), y, y_stride, lanes),
                        }
                    };
                }
                match rows_end - row {
                    1 => store!(1),
                    2 => store!(2),
                    3 => store!(3),
                    4 => store!(4),
                    5 => store!(5),
                    6 => store!(6),
                    7 => store!(7),
                    _ => store!(8),
                }
                octet += octets;
            }
            row = rows_end;
        }
        block = block_end;
    }
}

/// `$kernel`'s tile for `$w`'s format (one instance per format) over `$x`'s rows `$r`.
macro_rules! per_format {
    ($kernel:ident, $tile:expr, $x:expr, $w:expr, $r:ident) => {
        per_format!(@ $kernel, $tile, $x, $w, $r, Q4_0, Q4_1, Q8_0, Q5_0, Q4_K, Q6_K)
    };
    (@ $kernel:ident, $tile:expr, $x:expr, $w:expr, $r:ident, $($format:ident),*) => {
        match $w.format() {
            $(QuantFormat::$format => {
                const CODE: u8 = QuantFormat::$format.code();
                simd::$kernel::<CODE, $r>($tile, $x, $w)
            })*
        }
    };
}

/// The outputs of octet `octet` (eight output features) and activation rows `row..row + R`.
#[derive(Clone, Copy)]
struct Tile {
    row: usize,
    octet: usize,
}

impl Tile {
    /// Writes the tile's outputs `out` (from its first octet on) of columns `lanes`.
    unsafe fn store<const R: usize, const N: usize>(
        self,
        out: [[f32; N]; R],
        y: *mut f32,
        y_stride: usize,
        lanes: std::ops::Range<usize>,
    ) {
        for (r, values) in out.iter().enumerate() {
            let y_row = y.add((self.row + r) * y_stride);
            for column in lanes.clone() {
                *y_row.add(column) = values[column - self.octet * LANES];
            }
        }
    }

    unsafe fn run<const R: usize>(
        self,
        isa: Isa,
        x: &QuantisedRows,
        w: &PackedMatrix,
    ) -> [[f32; LANES]; R] {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Vnni | Isa::Vnni512 => per_format!(tile_vnni, self, x, w, R),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => per_format!(tile_avx2, self, x, w, R),
            _ => std::array::from_fn(|r| {
                std::array::from_fn(|lane| {
                    let column = (self.octet * LANES + lane).min(w.rows().max(1) - 1);
                    reference_dot(w, column, x, self.row + r)
                })
            }),
        }
    }

    /// The tile of this octet and the next on 512-bit registers ([`Isa::Vnni512`]).
    unsafe fn run_wide<const R: usize>(
        self,
        x: &QuantisedRows,
        w: &PackedMatrix,
    ) -> [[f32; 2 * LANES]; R] {
        #[cfg(target_arch = "x86_64")]
        return per_format!(tile_vnni512, self, x, w, R);
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("{:?} is detected on x86-64 only", Isa::Vnni512)
    }
}

/// `y[row][column]`, in exactly the order the SIMD tiles use.
pub fn reference_dot(w: &PackedMatrix, column: usize, x: &QuantisedRows, row: usize) -> f32 {
    let format = w.format();
    let blocks = x.blocks_per_row();
    let (mut halves, mut minimum) = ([0f32; 2], 0f32);
    for b in 0..blocks {
        let block = w.block(column, b);
        let at = row * blocks + b;
        let xq = &x.q[at * BLOCK..][..BLOCK];
        let product = |e: usize| {
            let quant = block_quant(format, &block, e);
            let quant = if format.nibbles() {
                i32::from(quant)
            } else {
                i32::from(quant as i8)
            };
            quant * i32::from(xq[e])
        };
        let [first, second] = [0, 1].map(|h| (h * 16..h * 16 + 16).map(product).sum::<i32>());
        let offset = format.quant_offset();
        let total = match format {
            QuantFormat::Q6_K => {
                let [s0, s1] = half_scales(&block).map(i32::from);
                let first_x = x.half_sum_q[at];
                s0 * (first - offset * first_x) + s1 * (second - offset * (x.sum_q[at] - first_x))
            }
            _ => first + second - offset * x.sum_q[at],
        };
        let d_w = block_scale(format, &block);
        let half = &mut halves[b % 2];
        *half = (total as f32).mul_add(d_w * x.d[at], *half);
        if format.has_minimum() {
            minimum = block_minimum(format, &block).mul_add(x.sum[at], minimum);
        }
    }
    let y = halves[0] + halves[1];
    if format.has_minimum() {
        y + minimum
    } else {
        y
    }
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    use super::{high_words_at, octet_bytes, scale_bytes, shared_octet_bytes};
    use super::{unit_blocks, unit_bytes};
    use super::{PackedMatrix, QuantisedRows, Tile};
    use super::{BLOCK, GROUP, LANES, STEPS};
    use crate::quant::QuantFormat;

    /// One octet's block unpacked: per four-quant step, the weights as unsigned bytes, and for
    /// signed-byte formats the signed bytes whose signs move onto the activations (zeros
    /// otherwise).
    struct Weights {
        unsigned: [__m256i; STEPS],
        signs: [__m256i; STEPS],
    }

    /// Runs `$body` with `$r` bound to each of `0..$rows` (at most eight), written out rather
    /// than looped: a loop over eight rows' products is too long for the compiler to unroll, and
    /// rolled it keeps every row's sums in memory.
    macro_rules! each_row {
        ($rows:expr, $r:ident, $body:block) => {
            each_row!(@ $rows, $r, $body, 0 1 2 3 4 5 6 7)
        };
        (@ $rows:expr, $r:ident, $body:block, $($k:literal)*) => {
            $(if $k < $rows {
                let $r: usize = $k;
                $body
            })*
        };
    }

    /// The kernel for one instruction set and register width: `$v` is the width's module
    /// ([`narrow`]: one octet a vector, [`wide`]: two), whose operations act lane by lane, so
    /// that every output feature gets the same operations whichever width computes it; `$dot4`
    /// adds four adjacent products of unsigned and signed bytes to each i32 lane;
    /// `$offset_signed` says whether it sums them without saturating, so that signed weights can
    /// be offset to unsigned ones (`w + 128`, the activations' `128 Σx` taken off after: the same
    /// integers) rather than their signs moved onto every row's activations.
    macro_rules! tile_kernel {
        ($name:ident, $features:literal, $v:ident, $dot4:ident, $offset_signed:literal) => {
            #[target_feature(enable = $features)]
            pub(crate) unsafe fn $name<const FORMAT: u8, const R: usize>(
                tile: Tile,
                x: &QuantisedRows,
                w: &PackedMatrix,
            ) -> [[f32; $v::LANES]; R] {
                const { assert!(R <= 8, "at most eight rows a pass") };
                // A constant in each instance, so that every format gets its own loop.
                let format = QuantFormat::from_code(FORMAT);
                let offset_signed = $offset_signed && !format.nibbles();
                let offset = if offset_signed {
                    128
                } else {
                    format.quant_offset()
                };
                let (blocks, unit) = (x.blocks_per_row(), unit_blocks(format));
                // Bytes from one octet's blocks to the next octet's.
                let octet_stride = blocks / unit * unit_bytes(format);
                // From four rows on, the minimum's terms run in a pass of their own over the
                // octet's headers (in L1 by then), in the same block order, so the same bits:
                // beside the products their R accumulators leave too few registers, and the
                // sums spill (`--example quant_kernel`, Q4_1, one thread, AMD Zen 4: 8 rows
                // 1.80 → 1.63 ms on VNNI and 2.87 → 2.68 on AVX2, 16 rows 4.05 → 3.35); below
                // four rows the second pass costs more than it saves (one row 0.36 → 0.41 ms).
                let minimum_apart = R >= 4;
                let first_block = w.data.as_ptr().add(tile.octet * octet_stride);
                let mut at = first_block;
                let mut halves = [[$v::zeros_ps(); 2]; R];
                let mut minimum = [$v::zeros_ps(); R];
                // Row `r`'s minimum term of the block at `block_at` whose header is `header`.
                macro_rules! minimum_term {
                    ($r:expr, $block_at:expr, $header:expr) => {{
                        let sum = $v::set1_ps(*x.sum.get_unchecked($block_at));
                        minimum[$r] = $v::fmadd_ps($header.minimum, sum, minimum[$r]);
                    }};
                }
                let mut shared = $v::Shared::zeros();
                // One block's products into each row's accumulator of parity `$parity` (a
                // constant, so that the accumulators can stay in registers).
                macro_rules! block {
                    ($b:expr, $parity:literal) => {{
                        let b = $b;
                        if format.shared_fields() > 0 && b % unit == 0 {
                            shared = $v::shared::<FORMAT>(at, octet_stride);
                            at = at.add(shared_octet_bytes(format));
                        }
                        let header = $v::header::<FORMAT>(at, octet_stride, &shared);
                        let weights = $v::weights::<FORMAT>(at, octet_stride, offset_signed);
                        each_row!(R, r, {
                            let block_at = (tile.row + r) * blocks + b;
                            let xq = x.q.as_ptr().add(block_at * BLOCK);
                            // The integer sums of the block's halves (steps 0..4 cover values
                            // 0..16), each in two chains when few rows leave the dot products'
                            // latency exposed.
                            let mut halves_ints = [$v::zeros_si(); 4];
                            for step in 0..STEPS {
                                let x4 =
                                    $v::activations::<FORMAT>(&weights, step, xq, offset_signed);
                                let chain = if R < 4 { step % 2 } else { 0 };
                                let sum = &mut halves_ints[step / (STEPS / 2) * 2 + chain];
                                *sum = $dot4(*sum, weights.unsigned[step], x4);
                            }
                            let first = $v::add_epi32(halves_ints[0], halves_ints[1]);
                            let second = $v::add_epi32(halves_ints[2], halves_ints[3]);
                            let sum_q = *x.sum_q.get_unchecked(block_at);
                            let ints = match header.half_scales {
                                Some([s0, s1]) => {
                                    // Each half's offset before its scale.
                                    let first_x = *x.half_sum_q.get_unchecked(block_at);
                                    let x0 = $v::set1_epi32(offset * first_x);
                                    let x1 = $v::set1_epi32(offset * (sum_q - first_x));
                                    $v::add_epi32(
                                        $v::mullo_epi32($v::sub_epi32(first, x0), s0),
                                        $v::mullo_epi32($v::sub_epi32(second, x1), s1),
                                    )
                                }
                                None if offset != 0 => $v::sub_epi32(
                                    $v::add_epi32(first, second),
                                    $v::set1_epi32(offset * sum_q),
                                ),
                                None => $v::add_epi32(first, second),
                            };
                            let scale =
                                $v::mul_ps(header.scale, $v::set1_ps(*x.d.get_unchecked(block_at)));
                            let half = &mut halves[r][$parity];
                            *half = $v::fmadd_ps($v::cvtepi32_ps(ints), scale, *half);
                            if format.has_minimum() && !minimum_apart {
                                minimum_term!(r, block_at, header);
                            }
                        });
                        at = at.add(octet_bytes(format));
                    }};
                }
                for pair in 0..blocks / 2 {
                    block!(2 * pair, 0);
                    block!(2 * pair + 1, 1);
                }
                if blocks % 2 == 1 {
                    block!(blocks - 1, 0);
                }
                if format.has_minimum() && minimum_apart {
                    at = first_block;
                    for b in 0..blocks {
                        if format.shared_fields() > 0 && b % unit == 0 {
                            shared = $v::shared::<FORMAT>(at, octet_stride);
                            at = at.add(shared_octet_bytes(format));
                        }
                        let header = $v::header::<FORMAT>(at, octet_stride, &shared);
                        each_row!(R, r, {
                            minimum_term!(r, (tile.row + r) * blocks + b, header);
                        });
                        at = at.add(octet_bytes(format));
                    }
                }
                // The last block's step past itself goes unused.
                let _ = at;
                std::array::from_fn(|r| {
                    let mut y = $v::add_ps(halves[r][0], halves[r][1]);
                    if format.has_minimum() {
                        y = $v::add_ps(y, minimum[r]);
                    }
                    let mut out = [0f32; $v::LANES];
                    $v::storeu_ps(out.as_mut_ptr(), y);
                    out
                })
            }
        };
    }

    mod avx2 {
        use super::*;
        // `maddubs` saturates its pairs' sums at i16: signed weights keep their signs moved.
        tile_kernel!(tile, "avx2,fma,f16c", narrow, dot4_avx2, false);
    }
    mod vnni {
        use super::*;
        tile_kernel!(
            tile,
            "avx2,fma,f16c,avx512vnni,avx512vl",
            narrow,
            dot4_vnni,
            true
        );
    }
    mod vnni512 {
        use super::*;
        tile_kernel!(
            tile,
            "avx2,fma,f16c,avx512f,avx512vnni,avx512vl",
            wide,
            dot4_vnni512,
            true
        );
    }
    pub(super) use avx2::tile as tile_avx2;
    pub(super) use vnni::tile as tile_vnni;
    pub(super) use vnni512::tile as tile_vnni512;

    /// One octet a vector: eight output features in a 256-bit register.
    mod narrow {
        pub(super) use std::arch::x86_64::{
            _mm256_add_epi32 as add_epi32, _mm256_add_ps as add_ps,
            _mm256_cvtepi32_ps as cvtepi32_ps, _mm256_fmadd_ps as fmadd_ps,
            _mm256_mul_ps as mul_ps, _mm256_mullo_epi32 as mullo_epi32,
            _mm256_set1_epi32 as set1_epi32, _mm256_set1_ps as set1_ps,
            _mm256_setzero_ps as zeros_ps, _mm256_setzero_si256 as zeros_si,
            _mm256_storeu_ps as storeu_ps, _mm256_sub_epi32 as sub_epi32,
        };

        // What the tile kernel names through the width (`$v::`), then what these loaders return.
        pub(super) use super::{activations, Shared, LANES};
        use super::{Header, Weights};

        /// The octet at `at`'s super-block fields (`_next`, the step to the next octet, is for
        /// [`super::wide`]).
        #[inline]
        #[target_feature(enable = "avx2,f16c")]
        pub(super) unsafe fn shared<const FORMAT: u8>(at: *const u8, _next: usize) -> Shared {
            Shared::load::<FORMAT>(at)
        }

        /// The octet at `at`'s block header.
        #[inline]
        #[target_feature(enable = "avx2,f16c")]
        pub(super) unsafe fn header<const FORMAT: u8>(
            at: *const u8,
            _next: usize,
            shared: &Shared,
        ) -> Header {
            Header::load::<FORMAT>(at, shared)
        }

        /// The octet at `at`'s block unpacked ([`super::unpack`]).
        #[inline]
        #[target_feature(enable = "avx2")]
        pub(super) unsafe fn weights<const FORMAT: u8>(
            at: *const u8,
            _next: usize,
            offset_signed: bool,
        ) -> Weights {
            super::unpack::<FORMAT>(at, offset_signed)
        }
    }

    /// Two octets a vector: sixteen output features in a 512-bit register, the octet at `at` in
    /// the low half and the one `next` bytes on in the high half. Each half is loaded and
    /// unpacked as [`narrow`] does it and the halves joined, so every lane holds the operands it
    /// holds there; the arithmetic is the same lane by lane, so every output keeps its bits. Per
    /// row and block, the broadcasts and the float fix-ups serve sixteen features instead of
    /// eight: about half the instructions per multiply-accumulate.
    mod wide {
        use std::arch::x86_64::*;
        pub(super) use std::arch::x86_64::{
            _mm512_add_epi32 as add_epi32, _mm512_add_ps as add_ps,
            _mm512_cvtepi32_ps as cvtepi32_ps, _mm512_fmadd_ps as fmadd_ps,
            _mm512_mul_ps as mul_ps, _mm512_mullo_epi32 as mullo_epi32,
            _mm512_set1_epi32 as set1_epi32, _mm512_set1_ps as set1_ps,
            _mm512_setzero_ps as zeros_ps, _mm512_setzero_si512 as zeros_si,
            _mm512_storeu_ps as storeu_ps, _mm512_sub_epi32 as sub_epi32,
        };

        use super::{GROUP, STEPS};

        /// Output features per vector.
        pub(super) const LANES: usize = 2 * super::LANES;

        /// Both octets' super-block fields.
        pub(super) struct Shared([super::Shared; 2]);

        impl Shared {
            #[inline]
            #[target_feature(enable = "avx2")]
            pub(super) unsafe fn zeros() -> Self {
                Self([super::Shared::zeros(), super::Shared::zeros()])
            }
        }

        /// Both octets' block headers, joined.
        pub(super) struct Header {
            pub(super) scale: __m512,
            pub(super) minimum: __m512,
            pub(super) half_scales: Option<[__m512i; 2]>,
        }

        /// Both octets' unpacked quants, joined (signs are never moved: `dpbusd` offsets signed
        /// weights instead).
        pub(super) struct Weights {
            pub(super) unsigned: [__m512i; STEPS],
        }

        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn join_ps(low: __m256, high: __m256) -> __m512 {
            let low = _mm512_castpd256_pd512(_mm256_castps_pd(low));
            _mm512_castpd_ps(_mm512_insertf64x4::<1>(low, _mm256_castps_pd(high)))
        }

        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn join_si(low: __m256i, high: __m256i) -> __m512i {
            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(low), high)
        }

        #[inline]
        #[target_feature(enable = "avx2,f16c")]
        pub(super) unsafe fn shared<const FORMAT: u8>(at: *const u8, next: usize) -> Shared {
            Shared([at, at.add(next)].map(|at| super::Shared::load::<FORMAT>(at)))
        }

        #[inline]
        #[target_feature(enable = "avx2,f16c,avx512f")]
        pub(super) unsafe fn header<const FORMAT: u8>(
            at: *const u8,
            next: usize,
            shared: &Shared,
        ) -> Header {
            let low = super::Header::load::<FORMAT>(at, &shared.0[0]);
            let high = super::Header::load::<FORMAT>(at.add(next), &shared.0[1]);
            Header {
                scale: join_ps(low.scale, high.scale),
                minimum: join_ps(low.minimum, high.minimum),
                half_scales: low
                    .half_scales
                    .zip(high.half_scales)
                    .map(|(l, h)| [join_si(l[0], h[0]), join_si(l[1], h[1])]),
            }
        }

        #[inline]
        #[target_feature(enable = "avx2,avx512f")]
        pub(super) unsafe fn weights<const FORMAT: u8>(
            at: *const u8,
            next: usize,
            offset_signed: bool,
        ) -> Weights {
            let format = crate::quant::QuantFormat::from_code(FORMAT);
            debug_assert!(
                offset_signed || format.nibbles(),
                "dpbusd offsets signed weights"
            );
            let low = super::unpack::<FORMAT>(at, offset_signed);
            let high = super::unpack::<FORMAT>(at.add(next), offset_signed);
            Weights {
                unsigned: std::array::from_fn(|s| join_si(low.unsigned[s], high.unsigned[s])),
            }
        }

        /// Step `step`'s four activation quants at `xq`, broadcast.
        #[inline]
        #[target_feature(enable = "avx512f")]
        pub(super) unsafe fn activations<const FORMAT: u8>(
            _weights: &Weights,
            step: usize,
            xq: *const i8,
            _offset_signed: bool,
        ) -> __m512i {
            _mm512_set1_epi32((xq.add(step * GROUP) as *const i32).read_unaligned())
        }
    }

    /// Eight f16s at `at` as f32s.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn f16s(at: *const u8) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(at as *const __m128i))
    }

    /// Eight unsigned bytes at `at` as f32s.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn unsigned_bytes(at: *const u8) -> __m256 {
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(at as *const _)))
    }

    /// Eight signed bytes at `at` as i32s.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn signed_bytes(at: *const u8) -> __m256i {
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(at as *const _))
    }

    /// One octet's super-block fields, per lane: `Q4_K`'s `d` and `dmin`, `Q6_K`'s `d` (zeros
    /// where a format has none).
    struct Shared {
        scale: __m256,
        minimum: __m256,
    }

    impl Shared {
        #[inline]
        #[target_feature(enable = "avx2")]
        unsafe fn zeros() -> Self {
            Self {
                scale: _mm256_setzero_ps(),
                minimum: _mm256_setzero_ps(),
            }
        }

        #[inline]
        #[target_feature(enable = "avx2,f16c")]
        unsafe fn load<const FORMAT: u8>(at: *const u8) -> Self {
            Self {
                scale: f16s(at),
                minimum: match QuantFormat::from_code(FORMAT).has_minimum() {
                    true => f16s(at.add(2 * LANES)),
                    false => _mm256_setzero_ps(),
                },
            }
        }
    }

    /// One octet's block header, per lane: the scale `d`, the minimum (zeros where the format
    /// has none), `Q6_K`'s half scales.
    struct Header {
        scale: __m256,
        minimum: __m256,
        half_scales: Option<[__m256i; 2]>,
    }

    impl Header {
        #[inline]
        #[target_feature(enable = "avx2,f16c")]
        unsafe fn load<const FORMAT: u8>(at: *const u8, shared: &Shared) -> Self {
            let format = QuantFormat::from_code(FORMAT);
            match format {
                // `d·sc` and `−(dmin·m)`, as `quant::block_scale` and `block_minimum` form them.
                QuantFormat::Q4_K => Self {
                    scale: _mm256_mul_ps(shared.scale, unsigned_bytes(at)),
                    minimum: _mm256_xor_ps(
                        _mm256_mul_ps(shared.minimum, unsigned_bytes(at.add(LANES))),
                        _mm256_set1_ps(-0.0),
                    ),
                    half_scales: None,
                },
                QuantFormat::Q6_K => Self {
                    scale: shared.scale,
                    minimum: _mm256_setzero_ps(),
                    half_scales: Some([signed_bytes(at), signed_bytes(at.add(LANES))]),
                },
                QuantFormat::Q4_1 => Self {
                    scale: f16s(at),
                    minimum: f16s(at.add(2 * LANES)),
                    half_scales: None,
                },
                QuantFormat::Q4_0 | QuantFormat::Q5_0 | QuantFormat::Q8_0 => Self {
                    scale: f16s(at),
                    minimum: _mm256_setzero_ps(),
                    half_scales: None,
                },
            }
        }
    }

    /// Step `step`'s four activation quants at `xq`, broadcast, signed by `Q8_0`'s weights
    /// unless they are `offset_signed` ([`unpack`]).
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn activations<const FORMAT: u8>(
        weights: &Weights,
        step: usize,
        xq: *const i8,
        offset_signed: bool,
    ) -> __m256i {
        let four = _mm256_set1_epi32((xq.add(step * GROUP) as *const i32).read_unaligned());
        if !QuantFormat::from_code(FORMAT).nibbles() && !offset_signed {
            _mm256_sign_epi8(four, weights.signs[step])
        } else {
            four
        }
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn dot4_avx2(acc: __m256i, unsigned: __m256i, signed: __m256i) -> __m256i {
        let pairs = _mm256_maddubs_epi16(unsigned, signed);
        _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
    }

    #[inline]
    #[target_feature(enable = "avx2,avx512vnni,avx512vl")]
    unsafe fn dot4_vnni(acc: __m256i, unsigned: __m256i, signed: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(acc, unsigned, signed)
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512vnni")]
    unsafe fn dot4_vnni512(acc: __m512i, unsigned: __m512i, signed: __m512i) -> __m512i {
        _mm512_dpbusd_epi32(acc, unsigned, signed)
    }

    /// [`QuantisedRows::quantise_block`] eight values a step, the same values: the maximum is
    /// exact in any order, `x · (1/d)` is one rounding either way, and halves round away from
    /// zero by the same truncation and comparison as [`super::round_half_away`]. The integers
    /// stay in registers: narrowed by two packs and a permutation, summed as vectors (exact in
    /// any order); stored through memory and summed one by one they cost three times as much.
    ///
    /// # Safety
    /// AVX2 is available.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn quantise_block(
        values: &[f32; BLOCK],
        q: &mut [i8; BLOCK],
    ) -> (f32, i32, i32) {
        let vectors: [__m256; BLOCK / LANES] =
            std::array::from_fn(|v| _mm256_loadu_ps(values.as_ptr().add(v * LANES)));
        let sign = _mm256_set1_ps(-0.0);
        let amax = vectors.iter().fold(_mm256_setzero_ps(), |m, &v| {
            _mm256_max_ps(m, _mm256_andnot_ps(sign, v))
        });
        let quad = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        let pair = _mm_max_ps(quad, _mm_movehl_ps(quad, quad));
        let amax = _mm_cvtss_f32(_mm_max_ss(pair, _mm_shuffle_ps(pair, pair, 1)));
        let d = amax / 127.0;
        let inverse = _mm256_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
        let half = _mm256_set1_ps(0.5);
        let [a, b, c, e] = vectors.map(|v| {
            let y = _mm256_mul_ps(v, inverse);
            let truncated = _mm256_cvttps_epi32(y);
            let fraction = _mm256_sub_ps(y, _mm256_cvtepi32_ps(truncated));
            // The comparisons' masks are −1 where true: less the first is up by one, plus the
            // second down by one.
            let up = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GE_OQ>(fraction, half));
            let down = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LE_OQ>(
                fraction,
                _mm256_sub_ps(_mm256_setzero_ps(), half),
            ));
            _mm256_add_epi32(_mm256_sub_epi32(truncated, up), down)
        });
        // Per 128-bit lane the packs give a₀₋₃ b₀₋₃ c₀₋₃ e₀₋₃ | a₄₋₇ b₄₋₇ c₄₋₇ e₄₋₇ (|q| ≤ 127, so
        // nothing saturates); the permutation puts the four-byte groups back in order.
        let bytes = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, e));
        let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        let bytes = _mm256_permutevar8x32_epi32(bytes, order);
        _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, bytes);
        let first = horizontal_sum_i32(_mm256_add_epi32(a, b));
        (d, first + horizontal_sum_i32(_mm256_add_epi32(c, e)), first)
    }

    /// The sum of `v`'s eight lanes.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn horizontal_sum_i32(v: __m256i) -> i32 {
        let quad = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        let pair = _mm_add_epi32(quad, _mm_unpackhi_epi64(quad, quad));
        _mm_cvtsi128_si32(_mm_add_epi32(pair, _mm_shuffle_epi32(pair, 1)))
    }

    /// Independent accumulator chains of [`dot4_rounds_vnni`] and [`dot4_rounds_avx2`]: enough to
    /// cover the instruction's latency on the hosts seen.
    pub(super) const CHAINS: usize = 12;

    /// `rounds` rounds of [`CHAINS`] independent `dot4`s (each round's unsigned operands the
    /// previous round's sums, so that nothing can be hoisted out of the loop).
    macro_rules! dot4_rounds {
        ($name:ident, $features:literal, $dot4:ident, $set1_epi8:ident) => {
            #[target_feature(enable = $features)]
            pub(super) unsafe fn $name(rounds: usize) {
                let signed = $set1_epi8(-5);
                let mut sums = [$set1_epi8(3); CHAINS];
                for _ in 0..rounds {
                    let last = sums;
                    for (k, sum) in sums.iter_mut().enumerate() {
                        *sum = $dot4(*sum, last[(k + 1) % CHAINS], signed);
                    }
                }
                std::hint::black_box(sums);
            }
        };
    }
    dot4_rounds!(
        dot4_rounds_vnni512,
        "avx512f,avx512vnni",
        dot4_vnni512,
        _mm512_set1_epi8
    );
    dot4_rounds!(
        dot4_rounds_vnni,
        "avx2,avx512vnni,avx512vl",
        dot4_vnni,
        _mm256_set1_epi8
    );
    dot4_rounds!(dot4_rounds_avx2, "avx2", dot4_avx2, _mm256_set1_epi8);

    /// The quants of the octet block at `at` (see [`PackedMatrix`]) as one [`Weights`]; signed
    /// bytes `offset_signed` become `w + 128` (else `|w|`, their signs kept).
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn unpack<const FORMAT: u8>(octet: *const u8, offset_signed: bool) -> Weights {
        let format = QuantFormat::from_code(FORMAT);
        let at = octet.add(scale_bytes(format));
        let mut weights = Weights {
            unsigned: [_mm256_setzero_si256(); STEPS],
            signs: [_mm256_setzero_si256(); STEPS],
        };
        if !format.nibbles() {
            for step in 0..STEPS {
                let signed = _mm256_loadu_si256(at.add(step * 32) as *const __m256i);
                if offset_signed {
                    weights.unsigned[step] = _mm256_xor_si256(signed, _mm256_set1_epi8(-128));
                } else {
                    weights.unsigned[step] = _mm256_sign_epi8(signed, signed);
                    weights.signs[step] = signed;
                }
            }
        } else {
            let mask = _mm256_set1_epi8(0x0f);
            for chunk in 0..STEPS / 2 {
                let packed = _mm256_loadu_si256(at.add(chunk * 32) as *const __m256i);
                weights.unsigned[2 * chunk] = _mm256_and_si256(packed, mask);
                weights.unsigned[2 * chunk + 1] =
                    _mm256_and_si256(_mm256_srli_epi16(packed, 4), mask);
            }
        }
        let bits = format.high_bits();
        // A 32-bit word holds the high bits of 32 / bits quants: 8 / bits steps of four.
        if let Some(steps_per_word) = (32 / GROUP).checked_div(bits) {
            // Step `s`'s high bits sit at bits `8i + bits·s'` of each lane's word
            // (`kernel_high_bit`, `s'` the step within its word): shifted to bit 4 of byte `i`,
            // they complete the four quants.
            let words_at = octet.add(high_words_at(format));
            let mask = _mm256_set1_epi8((((1 << bits) - 1) << 4) as i8);
            for (step, unsigned) in weights.unsigned.iter_mut().enumerate() {
                let word = step / steps_per_word;
                let words = _mm256_loadu_si256(words_at.add(word * 4 * LANES) as *const __m256i);
                let shift = 4 - (bits * (step % steps_per_word)) as i32;
                let moved = if shift >= 0 {
                    _mm256_sllv_epi32(words, _mm256_set1_epi32(shift))
                } else {
                    _mm256_srlv_epi32(words, _mm256_set1_epi32(-shift))
                };
                *unsigned = _mm256_or_si256(*unsigned, _mm256_and_si256(moved, mask));
            }
        }
        weights
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::quantise;
    use crate::quant::tests::random;

    const FORMATS: [QuantFormat; 6] = QuantFormat::ALL;

    /// `cols`, or the next width `format` takes (`Q4_K`: whole super-blocks).
    fn width(format: QuantFormat, cols: usize) -> usize {
        cols.next_multiple_of(format.row_multiple())
    }

    /// Columns `first..first + len` of the product, the rest left NaN.
    fn product(
        isa: Isa,
        x: &QuantisedRows,
        w: &PackedMatrix,
        first: usize,
        len: usize,
    ) -> Vec<f32> {
        let mut y = vec![f32::NAN; x.rows() * w.rows()];
        // SAFETY: every isa passed here was detected; y holds rows × w.rows() floats.
        unsafe { columns(isa, x, w, y.as_mut_ptr(), w.rows(), first, len) };
        y
    }

    /// Packing keeps every byte: unpacking gives the blocks back, and rows dequantise alike. The
    /// kernels stream the bits per weight of the format (`Q4_K`: the file's 4.5 bits, but its
    /// sub-block scales and minimums in a byte each rather than six bits: 4.625; `Q6_K` the
    /// file's 6.5625).
    #[test]
    fn packing_then_unpacking_gives_the_blocks_back() {
        let bits = [4.5, 5.0, 8.5, 5.5, 4.625, 6.5625];
        for (format, bits) in FORMATS.into_iter().zip(bits) {
            let (rows, cols) = (13, width(format, 96));
            let blocks = quantise(format, &random(rows * cols, 5), rows, cols);
            let packed = PackedMatrix::new(&blocks);
            assert_eq!(packed.unpacked().data(), blocks.data(), "{format:?}");
            // 13 rows padded to 16.
            assert_eq!(packed.bytes() as f64 * 8.0, 16.0 * cols as f64 * bits);
            let (mut a, mut b) = (vec![0f32; cols], vec![1f32; cols]);
            for row in 0..rows {
                blocks.dequantise_row(row, &mut a);
                packed.dequantise_row(row, &mut b);
                assert_eq!(a, b, "{format:?} row {row}");
            }
        }
    }

    /// Every instruction set gives the reference's bits, for every row count up to the largest
    /// verified tree and past the kernels' tiles (eight octets, eight activation rows), and for
    /// column ranges that split octets.
    #[test]
    fn every_instruction_set_and_row_count_gives_the_same_bits() {
        // The last too long for eight rows a pass (`PASS_ACTIVATION_BYTES`).
        let sizes = |f| [(f, width(f, 96)), (f, width(f, 352)), (f, width(f, 1056))];
        for (format, cols) in FORMATS.into_iter().flat_map(sizes) {
            // 131 features: sixteen whole octets and a partial one.
            let out = 131;
            let w = PackedMatrix::new(&quantise(format, &random(out * cols, 1), out, cols));
            let rows = 65;
            let xs = random(rows * cols, 2);
            let all = QuantisedRows::new(&xs, cols);
            let reference: Vec<f32> = (0..rows)
                .flat_map(|r| (0..out).map(move |c| (r, c)))
                .map(|(r, c)| reference_dot(&w, c, &all, r))
                .collect();
            for isa in Isa::all_available() {
                let what = format!("{format:?} {isa:?}, {cols} columns");
                assert_eq!(product(isa, &all, &w, 0, out), reference, "{what}");
                for count in [1, 2, 3, 4, 5, 6, 7, 8, 9, 17] {
                    let some = QuantisedRows::new(&xs[..count * cols], cols);
                    let got = product(isa, &some, &w, 0, out);
                    assert_eq!(got, reference[..count * out], "{what}, {count} rows");
                }
                let part = product(isa, &all, &w, 5, 70);
                for (at, (got, want)) in part.iter().zip(&reference).enumerate() {
                    match at % out {
                        5..75 => assert_eq!(got, want, "{what}, columns 5..75"),
                        _ => assert!(got.is_nan(), "{what}: column {} written", at % out),
                    }
                }
            }
        }
    }

    /// Against f32 products with the dequantised weights: the activations' 8-bit rounding is the
    /// only difference, well under 1 % of the output's scale.
    #[test]
    fn products_match_the_dequantised_weights_within_activation_rounding() {
        for format in FORMATS {
            let (out, cols, rows) = (40, width(format, 576), 3);
            let w = PackedMatrix::new(&quantise(format, &random(out * cols, 3), out, cols));
            let xs = random(rows * cols, 4);
            let got = product(kernel_isa(), &QuantisedRows::new(&xs, cols), &w, 0, out);
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

    /// The activations' rounding is `f32::round`'s, halves away from zero included.
    #[test]
    fn activations_round_as_f32_round_does() {
        let halves = (-255..=255).map(|k| k as f32 * 0.5);
        let near = [0.499_999_97f32, -0.499_999_97, 126.5, -126.5, 1e-30, -0.0];
        for y in halves
            .chain(near)
            .chain(random(4096, 9).iter().map(|v| v * 127.0))
        {
            assert_eq!(round_half_away(y), y.round() as i32, "{y}");
        }
        let rows = QuantisedRows::new(&[2.5f32; 32], 32);
        assert!(rows.q.iter().all(|&q| q == 127));
    }

    /// Eight values a step quantise as one at a time: random rows, rows of exact halves of the
    /// scale (every rounding tie), zeros and a lone value.
    #[test]
    fn activations_quantise_alike_on_every_instruction_set() {
        // Scales 1 and ½ exactly (maxima 127 and 63.5), so that x / d lands on every half.
        let tie = |k: usize, amax: f32| match k % 32 {
            0 => amax,
            i => (i as f32 - 15.5) * amax / 127.0,
        };
        let ties: Vec<f32> = (0..64)
            .map(|k| tie(k, if k < 32 { 127.0 } else { 63.5 }))
            .collect();
        let mut lone = vec![0f32; 64];
        lone[37] = -3.0;
        let rows = [random(640, 11), ties, vec![0.0; 64], lone];
        for x in rows {
            let portable = QuantisedRows::quantised_with(&x, 32, Isa::Portable);
            for isa in Isa::all_available() {
                let got = QuantisedRows::quantised_with(&x, 32, isa);
                assert_eq!(got.q, portable.q, "{isa:?}");
                assert_eq!(got.d, portable.d, "{isa:?}");
                assert_eq!(got.sum, portable.sum, "{isa:?}");
                assert_eq!(got.sum_q, portable.sum_q, "{isa:?}");
                assert_eq!(got.half_sum_q, portable.half_sum_q, "{isa:?}");
            }
        }
    }

    #[test]
    fn activation_blocks_of_zeros_quantise_to_zero() {
        let rows = QuantisedRows::new(&[0.0; 64], 64);
        assert!(rows.q.iter().all(|&q| q == 0));
        assert!(rows.d.iter().all(|&d| d == 0.0));
    }
}
