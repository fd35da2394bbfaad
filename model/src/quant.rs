//! Weights kept in llama.cpp's quantised block formats, so that decoding streams the 4.5–9 bits
//! per weight the file holds instead of 32.
//!
//! A [`QuantMatrix`] is `[rows, cols]` in the HF layout (one weight row per output feature), each
//! row a run of 32-element blocks. GGUF's `Q4_0`, `Q4_1`, `Q5_0` and `Q8_0` blocks are kept byte
//! for byte; `Q4_K`'s and `Q6_K`'s 32-value sub-blocks are re-expressed exactly at load
//! ([`crate::quant_gguf::GgufBlocks`]) as [`QuantFormat::Q4_K32`] and [`QuantFormat::Q6_K32`],
//! with the super-block scales multiplied in. Every value stays the one the file stands for (the
//! tests compare with candle's dequantisation bit for bit); the price is bytes: `Q4_K` streams 6
//! bits per weight instead of 4.5, `Q6_K` 9 instead of 6.6.
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
    /// One `Q4_K` sub-block: f32 scale `d` (the super-block's f16 scale times the 6-bit
    /// sub-block scale, exact in f32), f32 minimum `m` (minus the super-block's f16 minimum
    /// times the 6-bit sub-block minimum), 16 bytes of 4-bit `q` as in `Q4_1`: value `q · d + m`.
    Q4_K32,
    /// One `Q6_K` sub-block pair: the super-block's f16 scale `d`, the two signed 8-bit scales
    /// `s₀`, `s₁` of its 16-value halves, 32 signed bytes `q` (the 6-bit quants minus 32): value
    /// `(d · s) · q`, `s` the scale of the value's half.
    Q6_K32,
}

impl QuantFormat {
    /// Every format, for tests and benchmarks.
    pub const ALL: [Self; 6] = [
        Self::Q4_0,
        Self::Q4_1,
        Self::Q8_0,
        Self::Q5_0,
        Self::Q4_K32,
        Self::Q6_K32,
    ];

    /// Byte widths of the fields before a block's quants, in order (scale, minimum, …).
    pub const fn header_fields(self) -> &'static [usize] {
        match self {
            Self::Q4_0 | Self::Q8_0 => &[2],
            Self::Q4_1 => &[2, 2],
            Self::Q5_0 => &[2, 4],
            Self::Q4_K32 => &[4, 4],
            Self::Q6_K32 => &[2, 1, 1],
        }
    }

    /// Bytes of a block's fields before its quants.
    pub const fn header_bytes(self) -> usize {
        let (fields, mut at, mut bytes) = (self.header_fields(), 0, 0);
        while at < fields.len() {
            bytes += fields[at];
            at += 1;
        }
        bytes
    }

    /// Whether the quants are unsigned, their low four bits in nibbles (element `j` low, `j + 16`
    /// high in byte `j`; `Q5_0`'s fifth bit in its header), rather than signed bytes.
    pub const fn nibbles(self) -> bool {
        !matches!(self, Self::Q8_0 | Self::Q6_K32)
    }

    /// What the unsigned quants are offset by (`Q4_0`: 8, `Q5_0`: 16), else 0.
    pub const fn quant_offset(self) -> i32 {
        match self {
            Self::Q4_0 => 8,
            Self::Q5_0 => 16,
            _ => 0,
        }
    }

    /// Whether values add a per-block minimum (`q · d + m`).
    pub const fn has_minimum(self) -> bool {
        matches!(self, Self::Q4_1 | Self::Q4_K32)
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
            4 => Self::Q4_K32,
            _ => Self::Q6_K32,
        }
    }

    /// The format's name (`Q4_1`).
    pub const fn name(self) -> &'static str {
        match self {
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q8_0 => "Q8_0",
            Self::Q5_0 => "Q5_0",
            Self::Q4_K32 => "Q4_K32",
            Self::Q6_K32 => "Q6_K32",
        }
    }
}

/// Reads the little-endian f16 at `bytes[at..at + 2]` as an f32.
#[inline(always)]
pub(crate) fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([bytes[at], bytes[at + 1]])).to_f32()
}

/// Reads the little-endian f32 at `bytes[at..at + 4]`.
#[inline(always)]
pub(crate) fn f32_at(bytes: &[u8], at: usize) -> f32 {
    f32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

/// A block's scale `d` (for [`QuantFormat::Q6_K32`] the super-block's, before `s`).
#[inline(always)]
pub(crate) fn block_scale(format: QuantFormat, block: &[u8]) -> f32 {
    match format {
        QuantFormat::Q4_K32 => f32_at(block, 0),
        _ => f16_at(block, 0),
    }
}

/// A block's minimum `m` ([`QuantFormat::has_minimum`] formats).
#[inline(always)]
pub(crate) fn block_minimum(format: QuantFormat, block: &[u8]) -> f32 {
    match format {
        QuantFormat::Q4_K32 => f32_at(block, 4),
        _ => f16_at(block, 2),
    }
}

/// Element `e`'s quant in a block: unsigned for [`QuantFormat::nibbles`] formats (with
/// `Q5_0`'s fifth bit), else the signed byte (as its two's-complement `u8`).
#[inline(always)]
pub(crate) fn block_quant(format: QuantFormat, block: &[u8], e: usize) -> u8 {
    let quants = &block[format.header_bytes()..];
    if !format.nibbles() {
        return quants[e];
    }
    let low = (quants[e % (BLOCK / 2)] >> (4 * (e / (BLOCK / 2)))) & 0x0f;
    match format {
        QuantFormat::Q5_0 => low | (((high_bits(block) >> e) & 1) as u8) << 4,
        _ => low,
    }
}

/// `Q5_0`'s 32 high bits, bit `e` for element `e`.
#[inline(always)]
pub(crate) fn high_bits(block: &[u8]) -> u32 {
    u32::from_le_bytes([block[2], block[3], block[4], block[5]])
}

/// [`QuantFormat::Q6_K32`]'s scales of the block's two halves.
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
            QuantFormat::Q4_1 | QuantFormat::Q4_K32 => {
                f32::from(q) * d + block_minimum(format, block)
            }
            QuantFormat::Q8_0 => f32::from(q as i8) * d,
            QuantFormat::Q6_K32 => {
                let s = half_scales(block)[e / (BLOCK / 2)];
                d * f32::from(s) * f32::from(q as i8)
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
        if !cols.is_multiple_of(BLOCK) {
            return Err(format!(
                "{} rows of {cols} values: not a whole number of {BLOCK}-value blocks",
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
        Ok(Self {
            format,
            rows,
            cols,
            data,
        })
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
/// quantisers do: per block, Q8_0 and Q4_0 scale by the largest magnitude, Q4_1 (and Q4_K32)
/// span min..max; Q6_K32 picks a scale per 16-value half. For tests and tiny models; real models
/// arrive quantised.
pub fn quantise(format: QuantFormat, values: &[f32], rows: usize, cols: usize) -> QuantMatrix {
    assert_eq!(values.len(), rows * cols);
    let mut data = Vec::with_capacity(rows * cols / BLOCK * format.block_bytes());
    let f16_bytes = |v: f32| f16::from_f32(v).to_bits().to_le_bytes();
    let inverse = |d: f32| if d != 0.0 { 1.0 / d } else { 0.0 };
    let nibbles = |q: &dyn Fn(f32) -> u8, block: &[f32]| -> Vec<u8> {
        (0..BLOCK / 2)
            .map(|j| q(block[j]) | (q(block[j + BLOCK / 2]) << 4))
            .collect()
    };
    let amax = |values: &[f32]| values.iter().fold(0f32, |a, v| a.max(v.abs()));
    for block in values.chunks_exact(BLOCK) {
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
            QuantFormat::Q4_1 | QuantFormat::Q4_K32 => {
                let min = block.iter().copied().fold(f32::INFINITY, f32::min);
                let max = block.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let d = (max - min) / 15.0;
                if format == QuantFormat::Q4_1 {
                    data.extend_from_slice(&f16_bytes(d));
                    data.extend_from_slice(&f16_bytes(min));
                } else {
                    data.extend_from_slice(&d.to_le_bytes());
                    data.extend_from_slice(&min.to_le_bytes());
                }
                data.extend(nibbles(
                    &|v| (((v - min) * inverse(d) + 0.5) as u8).min(15),
                    block,
                ));
            }
            QuantFormat::Q6_K32 => {
                // Quants span −32..=31 and half scales −128..=127.
                let d = f16::from_f32(amax(block) / (31.0 * 127.0)).to_f32();
                data.extend_from_slice(&f16_bytes(d));
                let halves: Vec<&[f32]> = block.chunks(BLOCK / 2).collect();
                // Rounded up, so that the half's largest magnitude needs no clipping.
                let scales = halves
                    .iter()
                    .map(|h| (amax(h) * inverse(d) / 31.0).ceil().min(127.0) as i8);
                let scales: Vec<i8> = scales.collect();
                data.extend(scales.iter().map(|&s| s as u8));
                for (half, &s) in halves.iter().zip(&scales) {
                    let step = inverse(d * f32::from(s));
                    data.extend(
                        half.iter()
                            .map(|v| (v * step).round().clamp(-32.0, 31.0) as i8 as u8),
                    );
                }
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
        let values = random(4 * 64, 1);
        for (format, steps_per_max) in [
            (QuantFormat::Q8_0, 254.0),
            (QuantFormat::Q4_1, 15.0),
            (QuantFormat::Q4_K32, 15.0),
            (QuantFormat::Q4_0, 8.0),
            (QuantFormat::Q5_0, 16.0),
            (QuantFormat::Q6_K32, 62.0),
        ] {
            let matrix = quantise(format, &values, 4, 64);
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
