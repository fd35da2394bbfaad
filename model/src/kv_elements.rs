//! Writing the element types a KV cache stores (`--kv-dtype`: f32, f16 or bf16) from the few-row
//! layer's f32 rows: rounded to nearest, ties to even, as libtorch's `copy_` rounds, so a row
//! written here and the same row written by libtorch (a long prefill) hold the same bits. The row
//! kernels read them back widened exactly ([`crate::row_kernel::Element`]).

use crate::Dtype;

/// Rounds `src` into `src.len()` elements of `dtype` at `dst`.
///
/// # Safety
/// `dst` addresses room for `src.len()` elements of `dtype`, written by nobody else meanwhile.
pub(crate) unsafe fn narrow(dtype: Dtype, src: &[f32], dst: *mut u8) {
    match dtype {
        Dtype::F32 => std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut f32, src.len()),
        Dtype::F16 => {
            let dst = dst as *mut half::f16;
            for (i, &x) in src.iter().enumerate() {
                *dst.add(i) = half::f16::from_f32(x);
            }
        }
        Dtype::Bf16 => {
            let dst = dst as *mut half::bf16;
            for (i, &x) in src.iter().enumerate() {
                *dst.add(i) = half::bf16::from_f32(x);
            }
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use tch::{Device, Kind, Tensor};

    use super::*;
    use crate::row_kernel::{Bf16, Element, F16};

    /// Values across every range the rounding treats apart: normal, subnormal, ties, overflow.
    fn samples() -> Vec<f32> {
        let random = Tensor::randn([997], (Kind::Float, Device::Cpu)) * 40.0;
        let mut values = Vec::<f32>::try_from(random).unwrap();
        values.extend([
            0.0,
            -0.0,
            1.0,
            65504.0,
            65520.0,
            1e6,
            -1e6,
            6.0e-8,
            3.0e-5,
            1.0 + f32::EPSILON * 1024.0,
            f32::from_bits(0x3F80_8000),
            f32::from_bits(0x3F81_8000),
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MAX,
        ]);
        values
    }

    /// Rounding here gives libtorch's bits, and the row kernels read them back as libtorch's
    /// values, eight at a time and one at a time, for both 16-bit types.
    #[test]
    fn rounding_and_reading_back_match_libtorch() {
        if !crate::row_kernel::available() {
            return;
        }
        let values = samples();
        for (dtype, kind) in [(Dtype::F16, Kind::Half), (Dtype::Bf16, Kind::BFloat16)] {
            let torch = Tensor::from_slice(&values).to_kind(kind);
            let torch_bits = Vec::<i16>::try_from(torch.view_dtype(Kind::Int16)).unwrap();
            let mut ours = vec![0u16; values.len()];
            unsafe { narrow(dtype, &values, ours.as_mut_ptr() as *mut u8) };
            let ours_bits: Vec<i16> = ours.iter().map(|&b| b as i16).collect();
            assert_eq!(ours_bits, torch_bits, "{dtype:?}");
            let wide = Vec::<f32>::try_from(torch.to_kind(Kind::Float)).unwrap();
            let read = match dtype {
                Dtype::F16 => read_back::<F16>(&ours),
                _ => read_back::<Bf16>(&ours),
            };
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&read.0),
                bits(&wide[..read.0.len()]),
                "{dtype:?}, by eight"
            );
            assert_eq!(bits(&read.1), bits(&wide), "{dtype:?}, one by one");
        }
    }

    /// `stored` read by [`Element::load8`] (whole vectors) and by [`Element::load1`].
    fn read_back<E: Element>(stored: &[u16]) -> (Vec<f32>, Vec<f32>) {
        let elements = stored.as_ptr() as *const E;
        let mut by_eight = vec![0f32; stored.len() / 8 * 8];
        for (i, chunk) in by_eight.chunks_exact_mut(8).enumerate() {
            unsafe { load8_into::<E>(elements, i * 8, chunk) };
        }
        let one_by_one = (0..stored.len())
            .map(|i| unsafe { E::load1(elements, i) })
            .collect();
        (by_eight, one_by_one)
    }

    #[target_feature(enable = "avx2,f16c")]
    unsafe fn load8_into<E: Element>(elements: *const E, at: usize, out: &mut [f32]) {
        std::arch::x86_64::_mm256_storeu_ps(out.as_mut_ptr(), E::load8(elements, at));
    }
}
