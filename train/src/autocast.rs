//! Mixed precision: ATen's autocast with a chosen dtype (bf16 for training on CUDA).
//!
//! `tch::autocast` switches CUDA autocast on with its default dtype, f16, whose narrow exponent
//! needs loss scaling; bf16 has f32's range and trains without it, as SpecForge and EAGLE do.
//! The state is per thread in ATen; [`with_autocast`] restores what it found.

use std::ffi::c_int;

use tch::{Device, Kind};

extern "C" {
    fn headway_autocast_state(
        device_type: c_int,
        enabled: *mut bool,
        scalar_type: *mut c_int,
    ) -> bool;
    fn headway_autocast_set(
        device_type: c_int,
        enabled: bool,
        scalar_type: c_int,
        enter: bool,
    ) -> bool;
}

/// c10::DeviceType codes.
fn device_type(device: Device) -> c_int {
    match device {
        Device::Cpu => 0,
        Device::Cuda(_) => 1,
        Device::Mps => 13,
        Device::Vulkan => 10,
    }
}

/// The kinds autocast can run in, with their c10::ScalarType codes.
const AUTOCAST_KINDS: [(Kind, c_int); 2] = [(Kind::Half, 5), (Kind::BFloat16, 15)];

fn scalar_type(kind: Kind) -> anyhow::Result<c_int> {
    AUTOCAST_KINDS
        .iter()
        .find(|(k, _)| *k == kind)
        .map(|&(_, code)| code)
        .ok_or_else(|| anyhow::anyhow!("autocast runs in f16 or bf16, not {kind:?}"))
}

/// The kind products run in on `device` when autocast is on there.
pub fn active_kind(device: Device) -> Option<Kind> {
    let (mut enabled, mut scalar_type) = (false, 0);
    // SAFETY: a plain C function that writes only through the pointers given and catches every
    // C++ exception.
    let read =
        unsafe { headway_autocast_state(device_type(device), &mut enabled, &mut scalar_type) };
    let kind = AUTOCAST_KINDS
        .iter()
        .find(|&&(_, code)| code == scalar_type);
    kind.filter(|_| read && enabled).map(|&(kind, _)| kind)
}

/// Runs `f` with autocast to `kind` on `device`: matrix products in `kind`, reductions and
/// losses in f32 (ATen's per-op lists); parameters and their gradients keep their own kind.
pub fn with_autocast<T>(device: Device, kind: Kind, f: impl FnOnce() -> T) -> anyhow::Result<T> {
    let (device, scalar_type) = (device_type(device), scalar_type(kind)?);
    let (mut was_enabled, mut was_kind) = (false, 0);
    // SAFETY: plain C functions that write only through the pointers given and catch every
    // C++ exception.
    let read = unsafe { headway_autocast_state(device, &mut was_enabled, &mut was_kind) };
    anyhow::ensure!(
        read,
        "this libtorch has no autocast state for device type {device}"
    );
    // SAFETY: as above.
    let entered = unsafe { headway_autocast_set(device, true, scalar_type, true) };
    anyhow::ensure!(
        entered,
        "libtorch refused autocast to {kind:?} on device type {device}"
    );
    let result = f();
    // SAFETY: as above; restores the state read before entering.
    let left = unsafe { headway_autocast_set(device, was_enabled, was_kind, false) };
    anyhow::ensure!(
        left,
        "libtorch failed to leave autocast on device type {device}"
    );
    Ok(result)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Tensor;

    #[test]
    fn products_run_in_bf16_inside_and_f32_outside_with_f32_gradients() {
        let options = (Kind::Float, Device::Cpu);
        let weight = Tensor::ones([4, 3], options).set_requires_grad(true);
        let x = Tensor::ones([2, 4], options);
        let (product, loss) = with_autocast(Device::Cpu, Kind::BFloat16, || {
            let product = x.matmul(&weight);
            let loss = product.log_softmax(-1, Kind::Float).sum(Kind::Float);
            (product, loss)
        })
        .unwrap();
        assert_eq!(product.kind(), Kind::BFloat16);
        assert_eq!(loss.kind(), Kind::Float);
        assert_eq!(
            x.matmul(&weight).kind(),
            Kind::Float,
            "the state is restored"
        );
        assert_eq!(active_kind(Device::Cpu), None);
        loss.backward();
        assert_eq!(weight.grad().kind(), Kind::Float);
    }

    #[test]
    fn nested_regions_restore_the_outer_one() {
        let x = Tensor::ones([2, 2], (Kind::Float, Device::Cpu));
        let kinds = with_autocast(Device::Cpu, Kind::BFloat16, || {
            let inner = with_autocast(Device::Cpu, Kind::Half, || x.matmul(&x).kind()).unwrap();
            assert_eq!(active_kind(Device::Cpu), Some(Kind::BFloat16));
            (inner, x.matmul(&x).kind())
        })
        .unwrap();
        assert_eq!(kinds, (Kind::Half, Kind::BFloat16));
    }
}
