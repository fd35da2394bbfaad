//! A value and its copies on the other devices a forward's layers use, each copy made once: the
//! rotary tables and mask of a forward whose layers are spread over devices, the row index of a
//! KV cache compaction.

use tch::{Device, Tensor};

/// What can be copied to another device: a tensor, or the rotary tables.
pub(crate) trait Movable: Sized {
    fn device(&self) -> Device;
    fn moved_to(&self, device: Device) -> Self;
}

impl Movable for Tensor {
    fn device(&self) -> Device {
        Tensor::device(self)
    }

    fn moved_to(&self, device: Device) -> Self {
        self.to_device(device)
    }
}

impl Movable for (Tensor, Tensor) {
    fn device(&self) -> Device {
        self.0.device()
    }

    fn moved_to(&self, device: Device) -> Self {
        (self.0.to_device(device), self.1.to_device(device))
    }
}

/// A value and its copies on other devices, each made once.
pub(crate) struct OnDevices<T> {
    home: T,
    copies: Vec<(Device, T)>,
}

impl<T: Movable> OnDevices<T> {
    pub(crate) fn new(home: T) -> Self {
        Self {
            home,
            copies: Vec::new(),
        }
    }

    /// The value on `device`, copied there the first time.
    pub(crate) fn on(&mut self, device: Device) -> &T {
        if self.home.device() == device {
            return &self.home;
        }
        let at = match self.copies.iter().position(|(d, _)| *d == device) {
            Some(at) => at,
            None => {
                self.copies.push((device, self.home.moved_to(device)));
                self.copies.len() - 1
            }
        };
        &self.copies[at].1
    }
}
