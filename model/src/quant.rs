//! Weights kept in llama.cpp's quantised block formats (GGUF's `Q4_0`, `Q4_1`, `Q8_0`), so that
//! decoding streams the 4.5–8.5 bits per weight the file holds instead of 32.
//!
//! A [`QuantMatrix`] is `[rows, cols]` in the HF layout (one weight row per output feature), each
//! row a run of 32-element blocks exactly as GGUF stores them. [`crate::quant_kernel`] interleaves
//! its rows by eight ([`crate::quant_kernel::PackedMatrix`], the same bytes) and multiplies
//! activations by them without widening them; [`QuantMatrix::dequantise`] gives the f32 values the
//! blocks stand for, with candle's (and so `convert`'s) arithmetic, for the paths that need a
//! dense tensor (heads that copy the target's embeddings or LM head, GPUs).

use std::sync::Arc;

use half::f16;
use tch::{Device, Kind, Tensor};

/// Elements per block in every supported format.
pub const BLOCK: usize = 32;

/// A GGML block format Headway multiplies natively.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantFormat {
    /// f16 scale `d`, 16 bytes of 4-bit `q`: value `(q − 8) · d`.
    Q4_0,
    /// f16 scale `d`, f16 minimum `m`, 16 bytes of 4-bit `q`: value `q · d + m`.
    Q4_1,
    /// f16 scale `d`, 32 signed bytes `q`: value `q · d`.
    Q8_0,
}

impl QuantFormat {
    /// Bytes one block of [`BLOCK`] elements occupies.
    pub const fn block_bytes(self) -> usize {
        match self {
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q8_0 => 34,
        }
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
            _ => Self::Q8_0,
        }
    }

    /// ggml's name of the format (`Q4_1`).
    pub const fn name(self) -> &'static str {
        match self {
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q8_0 => "Q8_0",
        }
    }
}

/// Reads the little-endian f16 at `bytes[at..at + 2]` as an f32.
#[inline(always)]
pub(crate) fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([bytes[at], bytes[at + 1]])).to_f32()
}

/// The 32 values of one block, in element order.
pub(crate) fn dequantise_block(format: QuantFormat, block: &[u8], out: &mut [f32]) {
    let d = f16_at(block, 0);
    match format {
        QuantFormat::Q4_0 | QuantFormat::Q4_1 => {
            let (nibbles, m) = match format {
                QuantFormat::Q4_0 => (&block[2..18], None),
                _ => (&block[4..20], Some(f16_at(block, 2))),
            };
            for (j, &byte) in nibbles.iter().enumerate() {
                for (at, q) in [(j, byte & 0x0f), (j + BLOCK / 2, byte >> 4)] {
                    out[at] = match m {
                        None => (f32::from(q) - 8.0) * d,
                        Some(m) => f32::from(q) * d + m,
                    };
                }
            }
        }
        QuantFormat::Q8_0 => {
            for (value, &q) in out.iter_mut().zip(&block[2..2 + BLOCK]) {
                *value = f32::from(q as i8) * d;
            }
        }
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
/// quantisers do: per block, Q8_0 and Q4_0 scale by the largest magnitude, Q4_1 spans min..max.
/// For tests and tiny models; real models arrive quantised.
pub fn quantise(format: QuantFormat, values: &[f32], rows: usize, cols: usize) -> QuantMatrix {
    assert_eq!(values.len(), rows * cols);
    let mut data = Vec::with_capacity(rows * cols / BLOCK * format.block_bytes());
    for block in values.chunks_exact(BLOCK) {
        let f16_bytes = |v: f32| f16::from_f32(v).to_bits().to_le_bytes();
        match format {
            QuantFormat::Q8_0 => {
                let amax = block.iter().fold(0f32, |a, v| a.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                data.extend_from_slice(&f16_bytes(d));
                data.extend(block.iter().map(|v| (v * id).round() as i8 as u8));
            }
            QuantFormat::Q4_0 => {
                // The value of largest magnitude maps to −8 (llama.cpp's choice: one more level).
                let max = block
                    .iter()
                    .fold(0f32, |a, &v| if v.abs() > a.abs() { v } else { a });
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                data.extend_from_slice(&f16_bytes(d));
                let q = |v: f32| ((v * id + 8.5) as u8).min(15);
                data.extend((0..BLOCK / 2).map(|j| q(block[j]) | (q(block[j + BLOCK / 2]) << 4)));
            }
            QuantFormat::Q4_1 => {
                let min = block.iter().copied().fold(f32::INFINITY, f32::min);
                let max = block.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let d = (max - min) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                data.extend_from_slice(&f16_bytes(d));
                data.extend_from_slice(&f16_bytes(min));
                let q = |v: f32| (((v - min) * id + 0.5) as u8).min(15);
                data.extend((0..BLOCK / 2).map(|j| q(block[j]) | (q(block[j + BLOCK / 2]) << 4)));
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
            (QuantFormat::Q4_0, 8.0),
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
