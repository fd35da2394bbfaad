//! GGUF's block types, turned into the 32-value blocks of [`QuantFormat`] at load: `Q4_0`,
//! `Q4_1`, `Q5_0` and `Q8_0` as they are, `Q4_K` and `Q6_K` one 32-value sub-block per block
//! ([`QuantFormat::Q4_K`], [`QuantFormat::Q6_K`]). Each value is the one llama.cpp's (and
//! candle's) dequantisation gives, bit for bit: the sub-block scales are products of an f16 and
//! a 6- or 8-bit integer, exact in f32, and the tests replay candle's arithmetic.

use crate::quant::{QuantFormat, QuantMatrix, BLOCK, SUPER_BLOCK};

/// A GGUF block type whose matrices Headway multiplies without widening them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum GgufBlocks {
    Q4_0,
    Q4_1,
    Q8_0,
    Q5_0,
    Q4_K,
    Q6_K,
}

impl GgufBlocks {
    /// Values per block in the file.
    pub const fn values(self) -> usize {
        match self {
            Self::Q4_K | Self::Q6_K => SUPER_BLOCK,
            _ => BLOCK,
        }
    }

    /// Bytes per block in the file.
    pub const fn bytes(self) -> usize {
        match self {
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q8_0 => 34,
            Self::Q5_0 => 22,
            Self::Q4_K => 144,
            Self::Q6_K => 210,
        }
    }

    /// The format the kernels run it in.
    pub const fn format(self) -> QuantFormat {
        match self {
            Self::Q4_0 => QuantFormat::Q4_0,
            Self::Q4_1 => QuantFormat::Q4_1,
            Self::Q8_0 => QuantFormat::Q8_0,
            Self::Q5_0 => QuantFormat::Q5_0,
            Self::Q4_K => QuantFormat::Q4_K,
            Self::Q6_K => QuantFormat::Q6_K,
        }
    }

    /// `rows × cols` values stored as `bytes` of these blocks, as a [`QuantMatrix`]; an error
    /// names the size that is wrong.
    pub fn matrix(self, rows: usize, cols: usize, bytes: Vec<u8>) -> Result<QuantMatrix, String> {
        if !cols.is_multiple_of(self.values()) {
            return Err(format!(
                "{self:?} rows of {cols} values: not a whole number of {}-value blocks",
                self.values()
            ));
        }
        let expected = rows * cols / self.values() * self.bytes();
        if bytes.len() != expected {
            return Err(format!(
                "{self:?} [{rows}, {cols}] takes {expected} bytes, got {}",
                bytes.len()
            ));
        }
        let convert: fn(&[u8], &mut Vec<u8>) = match self {
            Self::Q4_0 | Self::Q4_1 | Self::Q5_0 | Self::Q8_0 => {
                return QuantMatrix::new(self.format(), rows, cols, bytes.into())
            }
            Self::Q4_K => q4_k_as_sub_blocks,
            Self::Q6_K => q6_k_as_sub_blocks,
        };
        let mut data = Vec::with_capacity(rows * cols / BLOCK * self.format().block_bytes());
        for block in bytes.chunks_exact(self.bytes()) {
            convert(block, &mut data);
        }
        QuantMatrix::new(self.format(), rows, cols, data.into())
    }
}

/// Sub-block `j`'s 6-bit scale and minimum from `Q4_K`'s 12 packed bytes (llama.cpp's
/// `get_scale_min_k4`).
fn q4_k_scale_min(j: usize, packed: &[u8]) -> (u8, u8) {
    if j < 4 {
        (packed[j] & 63, packed[j + 4] & 63)
    } else {
        (
            (packed[j + 4] & 0x0f) | ((packed[j - 4] >> 6) << 4),
            (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4),
        )
    }
}

/// A `Q4_K` super-block (f16 `d`, f16 `dmin`, 12 bytes of scales and minimums, 128 bytes of
/// nibbles: sub-blocks `2i` and `2i + 1` in the low and high nibbles of bytes `32i..32i + 32`)
/// as eight [`QuantFormat::Q4_K`] blocks: value `q · (d·sc) − dmin·m`.
fn q4_k_as_sub_blocks(block: &[u8], out: &mut Vec<u8>) {
    let (packed, quants) = (&block[4..16], &block[16..144]);
    for sub in 0..SUPER_BLOCK / BLOCK {
        let (scale, minimum) = q4_k_scale_min(sub, packed);
        out.extend_from_slice(&block[..4]);
        out.extend([scale, minimum]);
        let bytes = &quants[sub / 2 * BLOCK..][..BLOCK];
        let quant = |e: usize| (bytes[e] >> (4 * (sub % 2))) & 0x0f;
        out.extend((0..BLOCK / 2).map(|j| quant(j) | (quant(j + BLOCK / 2) << 4)));
    }
}

/// A `Q6_K` super-block (128 bytes of low nibbles, 64 of high bit pairs, 16 signed scales, f16
/// `d`; llama.cpp's `dequantize_row_q6_K` gives the places) as eight [`QuantFormat::Q6_K`]
/// blocks: value `(d · s) · (q − 32)`.
fn q6_k_as_sub_blocks(block: &[u8], out: &mut Vec<u8>) {
    let (low, high, scales) = (&block[..128], &block[128..192], &block[192..208]);
    for sub in 0..SUPER_BLOCK / BLOCK {
        // Half `n` of the super-block, and which of its four 32-value groups.
        let (n, group) = (sub / 4, sub % 4);
        let quant = |l: usize| {
            let nibble = (low[64 * n + l + 32 * (group % 2)] >> (4 * (group / 2))) & 0x0f;
            let pair = (high[32 * n + l] >> (2 * group)) & 3;
            (nibble, pair)
        };
        out.extend_from_slice(&block[208..210]);
        out.extend_from_slice(&scales[8 * n + 2 * group..][..2]);
        for half in 0..2 {
            let word = (0..BLOCK / 2).fold(0u32, |word, e| {
                word | u32::from(quant(16 * half + e).1) << (2 * e)
            });
            out.extend_from_slice(&word.to_le_bytes());
        }
        out.extend((0..BLOCK / 2).map(|j| quant(j).0 | quant(j + BLOCK / 2).0 << 4));
    }
}
