//! Data-parallel training on torch.distributed: ranks meet through c10d's TCPStore (what
//! torchrun's `env://` rendezvous uses) and sum gradients with c10d's Gloo process group on the
//! CPU, or its NCCL group on CUDA (built where CUDA's headers are found: `cfg(headway_nccl)`),
//! reached through `csrc/distributed.cpp` and `csrc/distributed_nccl.cpp` since tch 0.24 binds
//! none of them.
//!
//! Launch as PyTorch users launch: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR` and
//! `MASTER_PORT` in the environment (torchrun sets them), or the flags of [`DistributedArgs`].

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::time::Duration;

use anyhow::Context;
use headway_heads::Params;
use tch::{Device, Kind, Tensor};

use crate::objective::Metrics;

extern "C" {
    fn headway_dist_new(
        host: *const c_char,
        port: u16,
        rank: c_int,
        world: c_int,
        timeout_ms: i64,
        error: *mut *mut c_char,
    ) -> *mut c_void;
    fn headway_dist_free(group: *mut c_void);
    #[cfg(headway_nccl)]
    fn headway_dist_new_nccl(
        host: *const c_char,
        port: u16,
        rank: c_int,
        world: c_int,
        timeout_ms: i64,
        device: c_int,
        error: *mut *mut c_char,
    ) -> *mut c_void;
    fn headway_dist_free_error(error: *mut c_char);
    fn headway_dist_all_reduce_sum(
        group: *mut c_void,
        tensor: *mut torch_sys::C_tensor,
        error: *mut *mut c_char,
    ) -> bool;
    fn headway_dist_broadcast(
        group: *mut c_void,
        tensor: *mut torch_sys::C_tensor,
        root: c_int,
        error: *mut *mut c_char,
    ) -> bool;
}

/// Where this process stands among the ranks of a run, as torchrun describes it.
#[derive(clap::Args, Debug, Clone)]
pub struct DistributedArgs {
    /// This process's rank, 0 to --world-size − 1 (torchrun's RANK).
    #[arg(long, env = "RANK", default_value_t = 0)]
    pub rank: usize,
    /// Processes training together (torchrun's WORLD_SIZE); 1: no process group.
    #[arg(long, env = "WORLD_SIZE", default_value_t = 1)]
    pub world_size: usize,
    /// This process's rank on its machine (torchrun's LOCAL_RANK): `--device cuda` means
    /// cuda:LOCAL_RANK.
    #[arg(long, env = "LOCAL_RANK")]
    pub local_rank: Option<usize>,
    /// Host of rank 0, which serves the rendezvous store (torchrun's MASTER_ADDR).
    #[arg(long, env = "MASTER_ADDR", default_value = "127.0.0.1")]
    pub master_addr: String,
    /// Port of the rendezvous store (torchrun's MASTER_PORT).
    #[arg(long, env = "MASTER_PORT", default_value_t = 29500)]
    pub master_port: u16,
    /// Seconds a collective (or the rendezvous) may wait for the other ranks before this rank
    /// gives up; a rank that dies closes its connections and the others fail at once.
    #[arg(long, default_value_t = 600)]
    pub dist_timeout: u64,
    /// The process group: `nccl` sums CUDA tensors GPU to GPU, `gloo` any tensors through host
    /// memory; `auto` takes NCCL on CUDA and Gloo on the CPU, as PyTorch's default does.
    #[arg(long, value_enum, default_value = "auto")]
    pub dist_backend: BackendChoice,
}

/// `--dist-backend`.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendChoice {
    Auto,
    Gloo,
    Nccl,
}

/// The c10d backend a group runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Gloo,
    /// On the CUDA device of this index.
    Nccl(usize),
}

impl BackendChoice {
    /// The backend for a rank training on `device`; an error when NCCL is asked for where it
    /// cannot run.
    pub fn resolve(self, device: Device) -> anyhow::Result<Backend> {
        match (self, device) {
            (Self::Gloo, _) | (Self::Auto, Device::Cpu) => Ok(Backend::Gloo),
            (Self::Auto | Self::Nccl, Device::Cuda(index)) => Ok(Backend::Nccl(index)),
            (Self::Nccl, other) => anyhow::bail!(
                "--dist-backend nccl sums CUDA tensors, and this rank trains on {other:?}: use \
                 --device cuda, or --dist-backend gloo"
            ),
            (Self::Auto, other) => anyhow::bail!("no process group for device {other:?}"),
        }
    }
}

impl DistributedArgs {
    /// `device` with a bare `cuda` resolved to this process's GPU.
    pub fn device(&self, device: &str) -> String {
        match (device, self.local_rank) {
            ("cuda", Some(local)) if self.world_size > 1 => format!("cuda:{local}"),
            _ => device.to_string(),
        }
    }

    /// Joins the run's process group for a rank training on `device`; `None` for a single
    /// process.
    pub fn join(&self, device: Device) -> anyhow::Result<Option<ProcessGroup>> {
        anyhow::ensure!(
            self.world_size >= 1,
            "--world-size (WORLD_SIZE) must be at least 1"
        );
        anyhow::ensure!(
            self.rank < self.world_size,
            "--rank (RANK) {} is not below --world-size (WORLD_SIZE) {}",
            self.rank,
            self.world_size
        );
        if self.world_size == 1 {
            return Ok(None);
        }
        let group = ProcessGroup::join(
            &self.master_addr,
            self.master_port,
            self.rank,
            self.world_size,
            Duration::from_secs(self.dist_timeout),
            self.dist_backend.resolve(device)?,
        )
        .with_context(|| {
            format!(
                "rank {} of {}: joining the process group at {}:{}",
                self.rank, self.world_size, self.master_addr, self.master_port
            )
        })?;
        Ok(Some(group))
    }
}

/// A process group this process belongs to.
pub struct ProcessGroup {
    raw: *mut c_void,
    pub rank: usize,
    pub world: usize,
    /// Where the group's collectives take their tensors: the CPU for Gloo, the rank's GPU for
    /// NCCL (which reads only CUDA tensors).
    device: Device,
}

/// Turns a shim call's result into an error carrying its C++ message.
fn checked(ok: bool, error: *mut c_char, what: &str) -> anyhow::Result<()> {
    if ok {
        return Ok(());
    }
    // SAFETY: on failure the shim sets `error` to a NUL-terminated malloc'ed string, which is
    // read once here and freed with the shim's own free.
    let message = unsafe {
        let text = CStr::from_ptr(error).to_string_lossy().into_owned();
        headway_dist_free_error(error);
        text
    };
    anyhow::bail!("{what}: {message}")
}

impl ProcessGroup {
    /// Rendezvous at host:port (rank 0 serves the store and waits for all `world` ranks), then
    /// a group on `backend` whose collectives fail after `timeout`.
    pub fn join(
        host: &str,
        port: u16,
        rank: usize,
        world: usize,
        timeout: Duration,
        backend: Backend,
    ) -> anyhow::Result<Self> {
        let host = CString::new(host).context("MASTER_ADDR holds a NUL byte")?;
        let mut error = std::ptr::null_mut();
        let (rank_c, world_c) = (rank as c_int, world as c_int);
        let timeout_ms = timeout.as_millis() as i64;
        // SAFETY (both calls): the shim reads the C string during the call, and writes only
        // `error`.
        let (raw, device) = match backend {
            Backend::Gloo => {
                let raw = unsafe {
                    headway_dist_new(host.as_ptr(), port, rank_c, world_c, timeout_ms, &mut error)
                };
                (raw, Device::Cpu)
            }
            Backend::Nccl(index) => (
                new_nccl(&host, port, rank_c, world_c, timeout_ms, index, &mut error)?,
                Device::Cuda(index),
            ),
        };
        checked(!raw.is_null(), error, "rendezvous")?;
        Ok(Self {
            raw,
            rank,
            world,
            device,
        })
    }

    /// `tensor` (on the CPU) summed over all ranks, through the group's device.
    fn summed(&self, tensor: &Tensor) -> anyhow::Result<Tensor> {
        let mut on_device = tensor.to_device(self.device);
        self.all_reduce_sum(&mut on_device)?;
        Ok(on_device.to_device(Device::Cpu))
    }

    /// Rank `root`'s `tensor` (on the CPU), through the group's device.
    fn broadcast_from(&self, tensor: &Tensor, root: usize) -> anyhow::Result<Tensor> {
        let mut on_device = tensor.to_device(self.device);
        self.broadcast(&mut on_device, root)?;
        Ok(on_device.to_device(Device::Cpu))
    }

    /// Sums `tensor` over all ranks, in place.
    pub fn all_reduce_sum(&self, tensor: &mut Tensor) -> anyhow::Result<()> {
        let mut error = std::ptr::null_mut();
        // SAFETY: `raw` is a live group; the shim copies the tensor handle (a refcount) and
        // waits for the collective before it returns.
        let ok = unsafe { headway_dist_all_reduce_sum(self.raw, tensor.as_mut_ptr(), &mut error) };
        checked(ok, error, "all-reduce")
    }

    /// Overwrites `tensor` on every rank with rank `root`'s.
    pub fn broadcast(&self, tensor: &mut Tensor, root: usize) -> anyhow::Result<()> {
        let mut error = std::ptr::null_mut();
        // SAFETY: as in `all_reduce_sum`.
        let ok = unsafe {
            headway_dist_broadcast(self.raw, tensor.as_mut_ptr(), root as c_int, &mut error)
        };
        checked(ok, error, "broadcast")
    }

    /// Gives every rank rank 0's parameters (initialisation draws or a restored checkpoint that
    /// differ would otherwise train different heads).
    pub fn broadcast_params(&self, params: &Params) -> anyhow::Result<()> {
        let _no_grad = tch::no_grad_guard();
        for (name, param) in params.iter() {
            // A shallow clone shares the parameter's storage, which the broadcast overwrites.
            self.broadcast(&mut param.shallow_clone(), 0)
                .with_context(|| format!("parameter {name}"))?;
        }
        Ok(())
    }

    /// Sums the gradients over all ranks, in place, in one flat all-reduce. A parameter that
    /// this rank's micro-batches left without a gradient (an unused branch) gets zeros when
    /// another rank has one, so the flat buffers match; one no rank touched keeps none, as in a
    /// single process.
    pub fn all_reduce_gradients(&self, params: &Params) -> anyhow::Result<()> {
        let _no_grad = tch::no_grad_guard();
        self.check_same_count("parameters", params.len())?;
        let defined = self.summed(&Tensor::from_slice(
            &params
                .iter()
                .map(|(_, p)| f32::from(u8::from(p.grad().defined())))
                .collect::<Vec<f32>>(),
        ))?;
        let defined = Vec::<f32>::try_from(&defined)?;
        let mut grads = Vec::new();
        for ((_, param), &ranks) in params.iter().zip(&defined) {
            if ranks == 0.0 {
                continue;
            }
            if !param.grad().defined() {
                // Backward of a zero multiple: libtorch creates the gradient, all zeros.
                tch::with_grad(|| (param * 0.0).sum(Kind::Float).backward());
            }
            grads.push(param.grad());
        }
        if grads.is_empty() {
            return Ok(());
        }
        let parts: Vec<Tensor> = grads
            .iter()
            .map(|g| g.to_kind(Kind::Float).reshape([-1]))
            .collect();
        let mut flat = Tensor::cat(&parts, 0);
        self.all_reduce_sum(&mut flat)?;
        let mut offset = 0;
        for g in &grads {
            let n = g.numel() as i64;
            let mut g = g.shallow_clone();
            g.copy_(&flat.narrow(0, offset, n).view_as(&g));
            offset += n;
        }
        Ok(())
    }

    /// Refuses ranks that disagree on `count` (a different head), before collectives whose
    /// sizes depend on it would wait on each other until the timeout.
    fn check_same_count(&self, what: &str, count: usize) -> anyhow::Result<()> {
        let total = self.summed(&Tensor::from_slice(&[count as i64]))?;
        let total = total.int64_value(&[0]) as usize;
        anyhow::ensure!(
            total == count * self.world,
            "rank {} has {count} {what}, the {} ranks {total} in all: the ranks run different \
             heads",
            self.rank,
            self.world
        );
        Ok(())
    }

    /// Sums `metrics` and `tokens` over all ranks (each rank ran its own micro-batches); a figure
    /// some rank did not record counts zero there.
    pub fn all_reduce_metrics(
        &self,
        metrics: &mut Metrics,
        tokens: &mut usize,
    ) -> anyhow::Result<()> {
        for name in self.all_names(metrics.0.keys())? {
            metrics.0.entry(name).or_insert((0.0, 0.0));
        }
        let mut values: Vec<f64> = metrics.0.values().flat_map(|&(s, c)| [s, c]).collect();
        values.push(*tokens as f64);
        let summed = Vec::<f64>::try_from(&self.summed(&Tensor::from_slice(&values))?)?;
        for (slot, pair) in metrics.0.values_mut().zip(summed.chunks_exact(2)) {
            *slot = (pair[0], pair[1]);
        }
        *tokens = summed[summed.len() - 1] as usize;
        Ok(())
    }

    /// The union of every rank's `names`: each rank broadcasts its own in turn.
    fn all_names<'n>(
        &self,
        names: impl Iterator<Item = &'n String>,
    ) -> anyhow::Result<std::collections::BTreeSet<String>> {
        let own = names.cloned().collect::<Vec<_>>().join("\n");
        let mut union = std::collections::BTreeSet::new();
        for root in 0..self.world {
            let len = self.broadcast_from(&Tensor::from_slice(&[own.len() as i64]), root)?;
            let mut bytes = match root == self.rank {
                true => Tensor::from_slice(own.as_bytes()),
                false => Tensor::zeros([len.int64_value(&[0])], (Kind::Uint8, Device::Cpu)),
            };
            if bytes.numel() > 0 {
                bytes = self.broadcast_from(&bytes, root)?;
            }
            let text = String::from_utf8(Vec::<u8>::try_from(&bytes)?)?;
            union.extend(
                text.split('\n')
                    .filter(|n| !n.is_empty())
                    .map(str::to_string),
            );
        }
        Ok(union)
    }
}

/// An NCCL group's handle (null with `error` set on failure), or an error when this build has no
/// NCCL.
#[cfg(headway_nccl)]
fn new_nccl(
    host: &CStr,
    port: u16,
    rank: c_int,
    world: c_int,
    timeout_ms: i64,
    device: usize,
    error: &mut *mut c_char,
) -> anyhow::Result<*mut c_void> {
    // SAFETY: as for Gloo in `ProcessGroup::join`.
    Ok(unsafe {
        headway_dist_new_nccl(
            host.as_ptr(),
            port,
            rank,
            world,
            timeout_ms,
            device as c_int,
            error,
        )
    })
}

#[cfg(not(headway_nccl))]
fn new_nccl(
    _host: &CStr,
    _port: u16,
    _rank: c_int,
    _world: c_int,
    _timeout_ms: i64,
    _device: usize,
    _error: &mut *mut c_char,
) -> anyhow::Result<*mut c_void> {
    anyhow::bail!(
        "this headway-train was built without the NCCL process group (a CPU-only libtorch, or \
         CUDA's headers were not found at build time: `make venv` installs them); use \
         --dist-backend gloo"
    )
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        // SAFETY: `raw` came from headway_dist_new and is freed once.
        unsafe { headway_dist_free(self.raw) }
    }
}
