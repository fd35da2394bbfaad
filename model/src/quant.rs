//! Weights kept in llama.cpp's quantised block formats, so that decoding streams the 4.5–9 bits
//! per weight the file holds instead of 32.
//!
//! A [`QuantMatrix`] is `[rows, cols]` in the HF layout (one weight row per output feature), each
//! row a run of 32-element blocks. GGUF's `Q4_0`, `Q4_1`, `Q5_0` and `Q8_0` blocks are kept byte
//! for byte; `Q4_K`'s and `Q6_K`'s 32-value sub-blocks are re-expressed exactly at load
//! ([`crate::quant_gguf::GgufBlocks`]) as [`QuantFormat::Q4_K`] and [`QuantFormat::Q6_K`]
//! blocks, each carrying its super-block's scales, which the kernels' layout stores once per
//! super-block again: 4.625 and 6.5625 bits per weight against the file's 4.5 and 6.5625. Every
//! value stays the one the file stands for (the tests compare with candle's dequantisation bit
//! for bit).
//!
//! [`crate::quant_kernel`] interleaves the rows by eight ([`crate::quant_kernel::PackedMatrix`],
//! the same bytes) and multiplies activations by them without widening them;
//! [`QuantMatrix::dequantise`] gives the f32 values the blocks stand for, with candle's (and so
//! `convert`'s) arithmetic, for the paths that need a dense tensor (heads that copy the target's
//! embeddings or LM head, GPUs).

use std::sync::Arc;

use half::f16;
use tch::{Device, Kind, Tensor};

/// Elements per block in every format the kernels take.
pub const BLOCK: usize = 32;

/// Elements per super-block of the formats whose blocks share header fields
/// ([`QuantFormat::shared_fields`]): `Q4_K`'s 256.
pub const SUPER_BLOCK: usize = 256;

/// A 32-element block format Headway multiplies natively.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum QuantFormat {
    /// f16 scale `d`, 16 bytes of 4-bit `q`: value `(q − 8) · d`.
    Q4_0,
    /// f16 scale `d`, f16 minimum `m`, 16 bytes of 4-bit `q`: value `q · d + m`.
    Q4_1,
    /// f16 scale `d`, 32 signed bytes `q`: value `q · d`.
    Q8_0,
    /// f16 scale `d`, 32 high bits (bit `e` for element `e`), 16 bytes of low nibbles as in
    /// `Q4_0`: value `(q − 16) · d`, `q` the 5-bit quant.
    Q5_0,
    /// One `Q4_K` sub-block: its super-block's f16 scale `d` and f16 minimum scale `dmin` (the
    /// same in all eight blocks of a [`SUPER_BLOCK`]), the 6-bit sub-block scale `sc` and
    /// minimum `m` in a byte each, 16 bytes of 4-bit `q` as in `Q4_1`: value
    /// `q · (d·sc) − dmin·m`, both products exact in f32.
    Q4_K,
    /// One `Q6_K` sub-block pair: its super-block's f16 scale `d` (the same in all eight blocks
    /// of a [`SUPER_BLOCK`]), the signed 8-bit scales `s₀`, `s₁` of its 16-value halves, the
    /// quants' high two bits (bits `2e, 2e + 1` of the little-endian word of elements 0–15, then
    /// of 16–31), their low four bits as in `Q4_0`: value `(d · s) · (q − 32)`, `q` the 6-bit
    /// quant, `s` its half's scale.
    Q6_K,
}

impl QuantFormat {
    /// Every format, for tests and benchmarks.
    pub const ALL: [Self; 6] = [
        Self::Q4_0,
        Self::Q4_1,
        Self::Q8_0,
        Self::Q5_0,
        Self::Q4_K,
        Self::Q6_K,
    ];

    /// Byte widths of the fields before a block's quants, in order (scale, minimum, …).
    pub const fn header_fields(self) -> &'static [usize] {
        match self {
            Self::Q4_0 | Self::Q8_0 => &[2],
            Self::Q4_1 => &[2, 2],
            Self::Q5_0 => &[2, 4],
            Self::Q4_K => &[2, 2, 1, 1],
            Self::Q6_K => &[2, 1, 1, 4, 4],
        }
    }

    /// How many of the leading [`Self::header_fields`] belong to the block's super-block (the
    /// same in each of its blocks; `Q4_K`'s `d` and `dmin`), else 0.
    pub const fn shared_fields(self) -> usize {
        match self {
            Self::Q4_K => 2,
            Self::Q6_K => 1,
            _ => 0,
        }
    }

    /// What a row's length must be a multiple of: [`SUPER_BLOCK`] for formats with
    /// [`Self::shared_fields`], else [`BLOCK`].
    pub const fn row_multiple(self) -> usize {
        if self.shared_fields() > 0 {
            SUPER_BLOCK
        } else {
            BLOCK
        }
    }

    /// Where header field `field` starts in a block: the bytes of the fields before it.
    pub const fn field_start(self, field: usize) -> usize {
        let (fields, mut at, mut bytes) = (self.header_fields(), 0, 0);
        while at < field {
            bytes += fields[at];
            at += 1;
        }
        bytes
    }

    /// Bytes of the leading header fields a super-block shares.
    pub const fn shared_bytes(self) -> usize {
        self.field_start(self.shared_fields())
    }

    /// Bytes of a block's fields before its quants.
    pub const fn header_bytes(self) -> usize {
        self.field_start(self.header_fields().len())
    }

    /// Whether the quants are unsigned, their low four bits in nibbles (element `j` low, `j + 16`
    /// high in byte `j`; `Q5_0`'s fifth bit and `Q6_K`'s high two in the header), rather than
    /// signed bytes.
    pub const fn nibbles(self) -> bool {
        !matches!(self, Self::Q8_0)
    }

    /// What the unsigned quants are offset by (`Q4_0`: 8, `Q5_0`: 16, `Q6_K`: 32), else 0.
    pub const fn quant_offset(self) -> i32 {
        match self {
            Self::Q4_0 => 8,
            Self::Q5_0 => 16,
            Self::Q6_K => 32,
            _ => 0,
        }
    }

    /// Bits above the low four per quant, kept in header words (`Q5_0`: 1, `Q6_K`: 2).
    pub const fn high_bits(self) -> usize {
        match self {
            Self::Q5_0 => 1,
            Self::Q6_K => 2,
            _ => 0,
        }
    }

    /// Whether values add a per-block minimum (`q · d + m`).
    pub const fn has_minimum(self) -> bool {
        matches!(self, Self::Q4_1 | Self::Q4_K)
    }

    /// Bytes one block of [`BLOCK`] elements occupies.
    pub const fn block_bytes(self) -> usize {
        self.header_bytes() + if self.nibbles() { BLOCK / 2 } else { BLOCK }
    }

    /// A number per format, for kernels instantiated per format (const generics take integers).
    pub const fn code(self) -> u8 {
        self as u8
    }

    /// The format whose [`Self::code`] is `code`.
    pub const fn from_code(code: u8) -> Self {
        match code {
            0 => Self::Q4_0,
            1 => Self::Q4_1,
            2 => Self::Q8_0,
            3 => Self::Q5_0,
            4 => Self::Q4_K,
            _ => Self::Q6_K,
        }
    }

    /// The format's name (`Q4_1`).
    pub const fn name(self) -> &'static str {
        match self {
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q8_0 => "Q8_0",
            Self::Q5_0 => "Q5_0",
            Self::Q4_K => "Q4_K",
            Self::Q6_K => "Q6_K",
        }
    }
}

/// Reads the little-endian f16 at `bytes[at..at + 2]` as an f32.
#[inline(always)]
pub(crate) fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([bytes[at], bytes[at + 1]])).to_f32()
}

/// A block's scale `d` (for [`QuantFormat::Q6_K`] the super-block's, before `s`; for
/// [`QuantFormat::Q4_K`] the product `d·sc`).
#[inline(always)]
pub(crate) fn block_scale(format: QuantFormat, block: &[u8]) -> f32 {
    match format {
        QuantFormat::Q4_K => f16_at(block, 0) * f32::from(block[4]),
        _ => f16_at(block, 0),
    }
}

/// A block's minimum `m` ([`QuantFormat::has_minimum`] formats; for [`QuantFormat::Q4_K`]
/// `−dmin·m`).
#[inline(always)]
pub(crate) fn block_minimum(format: QuantFormat, block: &[u8]) -> f32 {
    match format {
        QuantFormat::Q4_K => -(f16_at(block, 2) * f32::from(block[5])),
        _ => f16_at(block, 2),
    }
}

/// Element `e`'s quant in a block: unsigned for [`QuantFormat::nibbles`] formats (with their
/// [`QuantFormat::high_bits`]), else the signed byte (as its two's-complement `u8`).
#[inline(always)]
pub(crate) fn block_quant(format: QuantFormat, block: &[u8], e: usize) -> u8 {
    let quants = &block[format.header_bytes()..];
    if !format.nibbles() {
        return quants[e];
    }
    let low = (quants[e % (BLOCK / 2)] >> (4 * (e / (BLOCK / 2)))) & 0x0f;
    let bits = format.high_bits();
    if bits == 0 {
        return low;
    }
    // Each 32-bit word holds the high bits of 32 / bits elements.
    let per_word = 32 / bits;
    let word = high_bits_word(format, block, e / per_word);
    let high = (word >> (bits * (e % per_word))) & ((1 << bits) - 1);
    low | (high as u8) << 4
}

/// Header field of the first word of high bits.
pub(crate) const fn high_bits_field(format: QuantFormat) -> usize {
    match format {
        QuantFormat::Q6_K => 3,
        _ => 1,
    }
}

/// Word `word` of the block's high bits ([`QuantFormat::high_bits`]): `Q5_0`'s one (bit `e` for
/// element `e`), `Q6_K`'s two (bits `2e, 2e + 1` for element `16·word + e`).
#[inline(always)]
pub(crate) fn high_bits_word(format: QuantFormat, block: &[u8], word: usize) -> u32 {
    let at = format.field_start(high_bits_field(format)) + 4 * word;
    u32::from_le_bytes([block[at], block[at + 1], block[at + 2], block[at + 3]])
}

/// [`QuantFormat::Q6_K`]'s scales of the block's two halves.
#[inline(always)]
pub(crate) fn half_scales(block: &[u8]) -> [i8; 2] {
    [block[2] as i8, block[3] as i8]
}

/// The 32 values of one block, in element order.
pub(crate) fn dequantise_block(format: QuantFormat, block: &[u8], out: &mut [f32]) {
    let d = block_scale(format, block);
    for (e, value) in out.iter_mut().enumerate().take(BLOCK) {
        let q = block_quant(format, block, e);
        *value = match format {
            QuantFormat::Q4_0 | QuantFormat::Q5_0 => {
                (f32::from(q) - format.quant_offset() as f32) * d
            }
            QuantFormat::Q4_1 | QuantFormat::Q4_K => {
                f32::from(q) * d + block_minimum(format, block)
            }
            QuantFormat::Q8_0 => f32::from(q as i8) * d,
            QuantFormat::Q6_K => {
                let s = half_scales(block)[e / (BLOCK / 2)];
                d * f32::from(s) * (i32::from(q) - format.quant_offset()) as f32
            }
        };
    }
}

/// A `[rows, cols]` matrix of quantised rows; `cols` is a multiple of [`BLOCK`]. Cloning shares
/// the bytes (a tied LM head and the embeddings are one matrix).
#[derive(Clone)]
pub struct QuantMatrix {
    format: QuantFormat,
    rows: usize,
    cols: usize,
    data: Arc<[u8]>,
}

impl std::fmt::Debug for QuantMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "QuantMatrix({} [{}, {}])",
            self.format.name(),
            self.rows,
            self.cols
        )
    }
}

impl QuantMatrix {
    /// `data` holds `rows` rows of `cols / 32` blocks each; an error says which size is wrong.
    pub fn new(
        format: QuantFormat,
        rows: usize,
        cols: usize,
        data: Arc<[u8]>,
    ) -> Result<Self, String> {
        let multiple = format.row_multiple();
        if !cols.is_multiple_of(multiple) {
            return Err(format!(
                "{} rows of {cols} values: not a whole number of {multiple}-value blocks",
                format.name()
            ));
        }
        let expected = rows * cols / BLOCK * format.block_bytes();
        if data.len() != expected {
            return Err(format!(
                "{} [{rows}, {cols}] takes {expected} bytes, got {}",
                format.name(),
                data.len()
            ));
        }
        let matrix = Self {
            format,
            rows,
            cols,
            data,
        };
        matrix.check_shared_fields()?;
        Ok(matrix)
    }

    /// That the blocks of each super-block agree on the fields they share.
    fn check_shared_fields(&self) -> Result<(), String> {
        let (shared, block_bytes) = (self.format.shared_bytes(), self.format.block_bytes());
        if shared == 0 {
            return Ok(());
        }
        let super_blocks = self.data.chunks_exact(SUPER_BLOCK / BLOCK * block_bytes);
        for (at, blocks) in super_blocks.enumerate() {
            let first = &blocks[..shared];
            if blocks
                .chunks_exact(block_bytes)
                .any(|b| &b[..shared] != first)
            {
                let per_row = self.cols / SUPER_BLOCK;
                return Err(format!(
                    "{} row {} super-block {}: its blocks differ in the super-block's scales",
                    self.format.name(),
                    at / per_row,
                    at % per_row
                ));
            }
        }
        Ok(())
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

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.cols / BLOCK * self.format.block_bytes()
    }

    pub fn data(&self) -> &[u8] {
        &self.data
    }

    /// The rows of `parts` one after another, or `None` when their formats or widths differ.
    pub fn concat_rows(parts: &[QuantMatrix]) -> Option<QuantMatrix> {
        let first = parts.first()?;
        if parts
            .iter()
            .any(|p| p.format != first.format || p.cols != first.cols)
        {
            return None;
        }
        let data: Vec<u8> = parts.iter().flat_map(|p| p.data.iter().copied()).collect();
        Some(Self {
            format: first.format,
            rows: parts.iter().map(|p| p.rows).sum(),
            cols: first.cols,
            data: data.into(),
        })
    }

    /// The matrix whose row `i` is this one's row `order[i]` (`order` a permutation of the rows).
    pub fn permute_rows(&self, order: &[usize]) -> QuantMatrix {
        assert_eq!(order.len(), self.rows, "a permutation of every row");
        let row_bytes = self.row_bytes();
        let mut data = Vec::with_capacity(self.data.len());
        for &row in order {
            data.extend_from_slice(&self.data[row * row_bytes..(row + 1) * row_bytes]);
        }
        Self {
            data: data.into(),
            ..*self
        }
    }

    /// Row `row`'s values into `out` (`cols` floats).
    pub fn dequantise_row(&self, row: usize, out: &mut [f32]) {
        let block_bytes = self.format.block_bytes();
        let bytes = &self.data[row * self.row_bytes()..(row + 1) * self.row_bytes()];
        for (block, values) in bytes
            .chunks_exact(block_bytes)
            .zip(out.chunks_exact_mut(BLOCK))
        {
            dequantise_block(self.format, block, values);
        }
    }

    /// Every value, as a dense `[rows, cols]` tensor of `kind` on `device`.
    pub fn dequantise(&self, kind: Kind, device: Device) -> Tensor {
        let ids: Vec<i64> = (0..self.rows as i64).collect();
        dequantise_rows(self.cols, &ids, |row, out| self.dequantise_row(row, out))
            .to_kind(kind)
            .to_device(device)
    }
}

/// Rows `ids` of a matrix `cols` wide, each written by `dequantise_row(row, out)`, as an f32
/// `[ids.len(), cols]` CPU tensor: an embedding lookup.
pub(crate) fn dequantise_rows(
    cols: usize,
    ids: &[i64],
    dequantise_row: impl Fn(usize, &mut [f32]),
) -> Tensor {
    let mut values = vec![0f32; ids.len() * cols];
    for (&id, out) in ids.iter().zip(values.chunks_exact_mut(cols)) {
        dequantise_row(id as usize, out);
    }
    Tensor::from_slice(&values).view([ids.len() as i64, cols as i64])
}

/// Quantises `values` (`rows × cols`, `cols` a multiple of 32) the way llama.cpp's reference
/// quantisers do: per block, Q8_0 and Q4_0 scale by the largest magnitude, Q4_1 spans min..max
/// (Q4_K too, its block scale and minimum rounded to 6-bit multiples of the super-block's); Q6_K
/// picks a scale per 16-value half. For tests and tiny models; real models
/// arrive quantised.
pub fn quantise(format: QuantFormat, values: &[f32], rows: usize, cols: usize) -> QuantMatrix {
    assert_eq!(values.len(), rows * cols);
    assert!(
        cols.is_multiple_of(format.row_multiple()),
        "whole super-blocks"
    );
    let mut data = Vec::with_capacity(rows * cols / BLOCK * format.block_bytes());
    let f16_bytes = |v: f32| f16::from_f32(v).to_bits().to_le_bytes();
    let inverse = |d: f32| if d != 0.0 { 1.0 / d } else { 0.0 };
    let nibbles = |q: &dyn Fn(f32) -> u8, block: &[f32]| -> Vec<u8> {
        (0..BLOCK / 2)
            .map(|j| q(block[j]) | (q(block[j + BLOCK / 2]) << 4))
            .collect()
    };
    let amax = |values: &[f32]| values.iter().fold(0f32, |a, v| a.max(v.abs()));
    // The minimum, and the step that spans min..max in 15.
    let span = |values: &[f32]| {
        let min = values.iter().copied().fold(f32::INFINITY, f32::min);
        let max = values.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        (min, (max - min) / 15.0)
    };
    for (i, block) in values.chunks_exact(BLOCK).enumerate() {
        match format {
            QuantFormat::Q8_0 => {
                let d = amax(block) / 127.0;
                data.extend_from_slice(&f16_bytes(d));
                data.extend(block.iter().map(|v| (v * inverse(d)).round() as i8 as u8));
            }
            QuantFormat::Q4_0 | QuantFormat::Q5_0 => {
                // The value of largest magnitude maps to −8 / −16 (llama.cpp's choice: one more
                // level).
                let max = block
                    .iter()
                    .fold(0f32, |a, &v| if v.abs() > a.abs() { v } else { a });
                let offset = format.quant_offset() as f32;
                let d = max / -offset;
                let q = |v: f32| ((v * inverse(d) + offset + 0.5) as u8).min(2 * offset as u8 - 1);
                data.extend_from_slice(&f16_bytes(d));
                if format == QuantFormat::Q5_0 {
                    let high = (0..BLOCK).fold(0u32, |h, e| h | u32::from(q(block[e]) >> 4) << e);
                    data.extend_from_slice(&high.to_le_bytes());
                }
                data.extend(nibbles(&|v| q(v) & 0x0f, block));
            }
            QuantFormat::Q4_1 => {
                let (min, d) = span(block);
                data.extend_from_slice(&f16_bytes(d));
                data.extend_from_slice(&f16_bytes(min));
                data.extend(nibbles(
                    &|v| (((v - min) * inverse(d) + 0.5) as u8).min(15),
                    block,
                ));
            }
            QuantFormat::Q4_K => {
                // Per super-block: 6-bit multiples of one scale and of one minimum step.
                let whole = &values[i * BLOCK / SUPER_BLOCK * SUPER_BLOCK..][..SUPER_BLOCK];
                let spans: Vec<(f32, f32)> = whole.chunks_exact(BLOCK).map(span).collect();
                let top = |f: fn(&(f32, f32)) -> f32| spans.iter().map(f).fold(0f32, f32::max);
                let d = f16::from_f32(top(|s| s.1) / 63.0).to_f32();
                let dmin = f16::from_f32(top(|s| -s.0.min(0.0)) / 63.0).to_f32();
                let (min, step) = span(block);
                let sc = (step * inverse(d)).round().min(63.0) as u8;
                let m = (-min.min(0.0) * inverse(dmin)).round().min(63.0) as u8;
                let (scale, offset) = (d * f32::from(sc), dmin * f32::from(m));
                data.extend_from_slice(&f16_bytes(d));
                data.extend_from_slice(&f16_bytes(dmin));
                data.extend([sc, m]);
                data.extend(nibbles(
                    &|v| ((v + offset) * inverse(scale)).round().clamp(0.0, 15.0) as u8,
                    block,
                ));
            }
            QuantFormat::Q6_K => {
                // Quants span −32..=31 (stored plus 32) and half scales −128..=127, one `d` per
                // super-block.
                let whole = &values[i * BLOCK / SUPER_BLOCK * SUPER_BLOCK..][..SUPER_BLOCK];
                let d = f16::from_f32(amax(whole) / (31.0 * 127.0)).to_f32();
                let halves: Vec<&[f32]> = block.chunks(BLOCK / 2).collect();
                // Rounded up, so that the half's largest magnitude needs no clipping.
                let scales: Vec<i8> = halves
                    .iter()
                    .map(|h| (amax(h) * inverse(d) / 31.0).ceil().min(127.0) as i8)
                    .collect();
                let quants: Vec<u8> = halves
                    .iter()
                    .zip(&scales)
                    .flat_map(|(half, &s)| {
                        let step = inverse(d * f32::from(s));
                        half.iter()
                            .map(move |v| ((v * step).round().clamp(-32.0, 31.0) + 32.0) as u8)
                    })
                    .collect();
                data.extend_from_slice(&f16_bytes(d));
                data.extend(scales.iter().map(|&s| s as u8));
                for half in quants.chunks(BLOCK / 2) {
                    let word =
                        (0..BLOCK / 2).fold(0u32, |w, e| w | u32::from(half[e] >> 4) << (2 * e));
                    data.extend_from_slice(&word.to_le_bytes());
                }
                data.extend(
                    (0..BLOCK / 2).map(|j| quants[j] & 0x0f | (quants[j + BLOCK / 2] & 0x0f) << 4),
                );
            }
        }
    }
    QuantMatrix::new(format, rows, cols, data.into()).expect("sizes computed above")
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// `len` values uniform in [−1, 1).
    pub(crate) fn random(len: usize, seed: u64) -> Vec<f32> {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    /// Each value comes back within half a quantisation step (Q8_0, Q4_1), or one step for Q4_0,
    /// whose largest magnitude maps to −8 so that the other side clips at +7 steps.
    #[test]
    fn quantising_then_dequantising_stays_within_a_step() {
        let values = random(4 * 256, 1);
        for (format, steps_per_max) in [
            (QuantFormat::Q8_0, 254.0),
            (QuantFormat::Q4_1, 15.0),
            // A 6-bit block scale and minimum: up to a whole 4-bit step.
            (QuantFormat::Q4_K, 7.5),
            (QuantFormat::Q4_0, 8.0),
            (QuantFormat::Q5_0, 16.0),
            (QuantFormat::Q6_K, 62.0),
        ] {
            let matrix = quantise(format, &values, 4, 256);
            let back = matrix.dequantise(Kind::Float, Device::Cpu);
            let back: Vec<f32> = Vec::<f32>::try_from(back.flatten(0, 1)).unwrap();
            for (block, got) in values.chunks(BLOCK).zip(back.chunks(BLOCK)) {
                let max = block.iter().fold(0f32, |a, v| a.max(v.abs()));
                for (v, g) in block.iter().zip(got) {
                    // Plus the f16 rounding of the scale.
                    assert!(
                        (v - g).abs() <= max / steps_per_max * 1.01 + 2e-3,
                        "{format:?}: {v} vs {g}"
                    );
                }
            }
        }
    }

    #[test]
    fn sizes_that_do_not_match_are_refused_with_both_numbers() {
        let err = QuantMatrix::new(QuantFormat::Q4_1, 2, 64, vec![0u8; 79].into()).unwrap_err();
        assert!(err.contains("80 bytes") && err.contains("79"), "{err}");
        let err = QuantMatrix::new(QuantFormat::Q8_0, 2, 40, vec![0u8; 10].into()).unwrap_err();
        assert!(err.contains("40 values"), "{err}");
        let err = QuantMatrix::new(QuantFormat::Q4_K, 1, 96, vec![0u8; 66].into()).unwrap_err();
        assert!(
            err.contains("96 values") && err.contains("256-value"),
            "{err}"
        );
    }

    /// A `Q4_K` super-block's blocks carry its scales each; blocks that disagree are refused.
    #[test]
    fn q4_k_blocks_that_disagree_on_their_super_block_are_refused() {
        let good = quantise(QuantFormat::Q4_K, &random(2 * 512, 6), 2, 512);
        let mut bytes = good.data().to_vec();
        // Row 1, super-block 1, its third block's `dmin`.
        let block = (512 + 256 + 64) / BLOCK * QuantFormat::Q4_K.block_bytes();
        bytes[block + 2] ^= 1;
        let err = QuantMatrix::new(QuantFormat::Q4_K, 2, 512, bytes.into()).unwrap_err();
        assert!(err.contains("row 1 super-block 1"), "{err}");
    }

    #[test]
    fn concatenation_and_permutation_move_whole_rows() {
        let a = quantise(QuantFormat::Q4_1, &random(2 * 32, 2), 2, 32);
        let b = quantise(QuantFormat::Q4_1, &random(32, 3), 1, 32);
        let joined = QuantMatrix::concat_rows(&[a.clone(), b.clone()]).unwrap();
        assert_eq!(joined.rows(), 3);
        let swapped = joined.permute_rows(&[2, 0, 1]);
        let row = |m: &QuantMatrix, r: usize| {
            let mut out = vec![0f32; 32];
            m.dequantise_row(r, &mut out);
            out
        };
        assert_eq!(row(&swapped, 0), row(&b, 0));
        assert_eq!(row(&swapped, 2), row(&a, 1));
        let q8 = quantise(QuantFormat::Q8_0, &random(32, 4), 1, 32);
        assert!(QuantMatrix::concat_rows(&[a, q8]).is_none());
    }
}
