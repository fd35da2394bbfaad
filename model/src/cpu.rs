//! Who runs a forward's work on the CPU: a policy its caller picks for every forward, never a
//! process-wide switch, so two users of one model (feature extraction beside regeneration, a
//! server beside a benchmark) cannot change each other's arithmetic.
//!
//! Decoding and tree verification multiply a few activation rows by every weight matrix, which
//! libtorch's f32 `linear` does at a third of the memory bandwidth on one thread; Headway's own
//! kernels ([`crate::linear`]) split the output features over a [`SpinPool`] instead. Feature
//! extraction and training multiply thousands of rows, where libtorch's BLAS is at least as fast
//! and every other op (attention, norms, activations) wants all the cores too. Both pools on the
//! same cores measured about 8× slower (168 ms instead of 22 ms per SmolLM2 decode step): each
//! one's spinning workers keep the other's off the cores they wait for. So the decode policy cuts
//! libtorch to one thread and the batch policy leaves the spin pool idle (its workers park 2 ms
//! after their last job).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use crate::spin_pool::SpinPool;

/// The CPU threads a target runs on: a spin pool (started at first use) for Headway's kernels and
/// the thread count libtorch gets in batch work. Pools are a process's cores, not a setting:
/// every user asking for the same number of threads (a target and its draft model, parallel
/// tests) shares one pool, whose jobs run one at a time, because two pools spinning on the same
/// cores starve each other.
#[derive(Clone)]
pub struct CpuThreads {
    threads: usize,
    pool: Arc<OnceLock<Arc<SpinPool>>>,
}

impl CpuThreads {
    /// `threads` threads; 0 means libtorch's default (one per core).
    pub fn new(threads: usize) -> Self {
        let threads = match threads {
            0 => default_threads(),
            n => n,
        };
        Self {
            threads,
            pool: Arc::new(OnceLock::new()),
        }
    }

    /// `threads` threads as a user asked for them (`--threads`), refused when more than the
    /// cores this process may run on: spinning workers beyond them only take turns on the cores
    /// and wait for each other (999 threads on 2 cores took 309 s for 2 tokens).
    pub fn checked(threads: usize) -> crate::Result<Self> {
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        if threads > cores {
            return Err(crate::ModelError::Invalid {
                field: "--threads",
                message: format!(
                    "{threads} is more than the {cores} core(s) this process may run on; more \
                     threads than cores only spin against each other (0 gives one per core)"
                ),
            });
        }
        Ok(Self::new(threads))
    }

    /// Number of threads.
    pub fn count(&self) -> usize {
        self.threads
    }

    /// The policy for few-row work: decoding, tree verification, drafting.
    pub fn decode(&self) -> CpuPolicy {
        CpuPolicy::Decode(self.clone())
    }

    /// The policy for many-row work: feature extraction, training.
    pub fn batch(&self) -> CpuPolicy {
        CpuPolicy::Batch {
            threads: self.threads,
        }
    }

    pub(crate) fn pool(&self) -> &SpinPool {
        self.pool.get_or_init(|| shared_pool(self.threads))
    }
}

/// The process's pool of `threads` threads, started when no live user holds one; it stops when
/// its last user is dropped.
fn shared_pool(threads: usize) -> Arc<SpinPool> {
    static POOLS: OnceLock<Mutex<HashMap<usize, Weak<SpinPool>>>> = OnceLock::new();
    let mut pools = POOLS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(pool) = pools.get(&threads).and_then(Weak::upgrade) {
        return pool;
    }
    let pool = Arc::new(SpinPool::new(threads));
    pools.insert(threads, Arc::downgrade(&pool));
    pool
}

impl Default for CpuThreads {
    /// libtorch's default thread count.
    fn default() -> Self {
        Self::new(0)
    }
}

/// libtorch's intra-op thread count as the process started (later policies change it).
fn default_threads() -> usize {
    static DEFAULT: OnceLock<usize> = OnceLock::new();
    *DEFAULT.get_or_init(|| tch::get_num_threads().max(1) as usize)
}

/// How one forward runs on the CPU (other devices, and tensors that need gradients, always run
/// in libtorch).
#[derive(Clone)]
pub enum CpuPolicy {
    /// Few rows per product: f32 linear layers on Headway's kernels over the threads' spin pool,
    /// libtorch's other ops on one thread.
    Decode(CpuThreads),
    /// Many rows per product: everything in libtorch, on `threads` threads.
    Batch { threads: usize },
}

impl CpuPolicy {
    /// Gives libtorch the thread count this policy wants; a forward calls it before its first op.
    /// Cheap when the count is already right (the common case: one policy per thread at a time).
    pub fn enter(&self) {
        let wanted = match self {
            Self::Decode(_) => 1,
            Self::Batch { threads } => *threads as i32,
        };
        if tch::get_num_threads() != wanted {
            tch::set_num_threads(wanted);
        }
    }

    /// Fork-joins Headway's kernels have run under this policy's pool so far (0 where libtorch
    /// runs them): a forward's count is the difference across it.
    pub fn fork_joins(&self) -> usize {
        self.pool().map_or(0, SpinPool::jobs)
    }

    /// The spin pool Headway's kernels run on under this policy (`None`: libtorch runs them).
    pub(crate) fn pool(&self) -> Option<&SpinPool> {
        match self {
            Self::Decode(threads) => Some(threads.pool()),
            Self::Batch { .. } => None,
        }
    }

    /// Threads the policy runs on.
    /// Runs `f` on the spin pool of this policy's threads: the decode pool, or for batch work a
    /// pool of as many threads (shared by every user of that count). For products libtorch
    /// cannot run (quantised weights).
    pub(crate) fn with_pool<T>(&self, f: impl FnOnce(&SpinPool) -> T) -> T {
        match self {
            Self::Decode(threads) => f(threads.pool()),
            Self::Batch { threads } => f(&shared_pool(*threads)),
        }
    }

    pub fn threads(&self) -> usize {
        match self {
            Self::Decode(threads) => threads.count(),
            Self::Batch { threads } => *threads,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::linear::Linear;
    use tch::{Device, Kind, Tensor};

    /// Two users of one set of weights in one process, one decoding and one extracting, each get
    /// their own policy's arithmetic, bit for bit, however their forwards interleave.
    #[test]
    fn concurrent_users_keep_their_own_policy() {
        let weight = Tensor::randn([301, 576], (Kind::Float, Device::Cpu));
        let x = Tensor::randn([3, 576], (Kind::Float, Device::Cpu));
        let threads = CpuThreads::new(2);
        let run = |policy: CpuPolicy, weight: Tensor, x: Tensor| {
            let layer = Linear::new(weight, None);
            policy.enter();
            let first = layer.forward(&x, &policy);
            for _ in 0..50 {
                policy.enter();
                assert!(layer.forward(&x, &policy).equal(&first));
            }
            first
        };
        let (decoded, extracted) = std::thread::scope(|s| {
            let (w, v) = (weight.shallow_clone(), x.shallow_clone());
            let decode = threads.decode();
            let a = s.spawn(move || run(decode, w, v));
            let (w, v) = (weight.shallow_clone(), x.shallow_clone());
            let batch = threads.batch();
            let b = s.spawn(move || run(batch, w, v));
            (a.join().unwrap(), b.join().unwrap())
        });
        let alone = Linear::new(weight.shallow_clone(), None);
        let decode = threads.decode();
        decode.enter();
        assert!(decoded.equal(&alone.forward(&x, &decode)));
        let batch = threads.batch();
        batch.enter();
        assert!(extracted.equal(&alone.forward(&x, &batch)));
    }

    #[test]
    fn more_threads_than_cores_are_refused_naming_both() {
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        assert_eq!(CpuThreads::checked(cores).unwrap().count(), cores);
        assert!(CpuThreads::checked(0).is_ok());
        let error = CpuThreads::checked(999)
            .err()
            .expect("999 threads refused")
            .to_string();
        assert!(
            error.contains("--threads: 999") && error.contains(&format!("{cores} core")),
            "{error}"
        );
    }

    #[test]
    fn decode_cuts_libtorch_to_one_thread_and_batch_gives_it_all() {
        let threads = CpuThreads::new(2);
        threads.decode().enter();
        assert_eq!(tch::get_num_threads(), 1);
        threads.batch().enter();
        assert_eq!(tch::get_num_threads(), 2);
        assert_eq!(threads.decode().threads(), 2);
    }
}
