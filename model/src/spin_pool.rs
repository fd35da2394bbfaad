//! A tiny fork-join pool whose workers spin between jobs, for the many short parallel matrix
//! products of decoding.
//!
//! One decoded token runs about 120 products of 0.1–3 ms each with other ops between them. A pool
//! that puts idle workers to sleep (rayon, OpenMP's passive policy) pays a futex wake-up and a
//! reschedule on each, which measured here cost more than the second core gained. These workers
//! spin for [`SPIN_BEFORE_PARK`] after each job and only then park, so during decoding a job starts
//! within a microsecond and an idle process still sleeps.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::{self, Thread};
use std::time::{Duration, Instant};

const SPIN_BEFORE_PARK: Duration = Duration::from_millis(2);

/// The job currently published: a borrowed closure with its lifetime erased. It is only read
/// between the publishing `generation` bump and the caller's wait for `pending == 0`, during which
/// the borrow is alive (see [`SpinPool::run`]).
struct Shared {
    generation: AtomicUsize,
    pending: AtomicUsize,
    job: std::sync::Mutex<Option<JobPtr>>,
    sleeping: Vec<AtomicBool>,
    /// Set when the pool is dropped: workers return instead of waiting for the next job.
    stopping: AtomicBool,
}

#[derive(Clone, Copy)]
struct JobPtr(*const (dyn Fn(usize) + Sync));

// SAFETY: the pointee is `Sync`, and `run` keeps it alive until every worker is done with it.
unsafe impl Send for JobPtr {}

/// A pool of `workers` spinning threads plus the calling thread.
pub struct SpinPool {
    shared: Arc<Shared>,
    threads: Vec<Thread>,
    handles: Vec<thread::JoinHandle<()>>,
    /// Serialises callers: one job at a time.
    busy: std::sync::Mutex<()>,
    /// Jobs run so far: each a fork and a join where there are workers.
    jobs: AtomicUsize,
}

impl SpinPool {
    /// A pool that runs jobs on `parallelism` threads: the caller and `parallelism - 1` workers.
    pub fn new(parallelism: usize) -> Self {
        let workers = parallelism.saturating_sub(1);
        let shared = Arc::new(Shared {
            generation: AtomicUsize::new(0),
            pending: AtomicUsize::new(0),
            job: std::sync::Mutex::new(None),
            sleeping: (0..workers).map(|_| AtomicBool::new(false)).collect(),
            stopping: AtomicBool::new(false),
        });
        let handles: Vec<thread::JoinHandle<()>> = (0..workers)
            .map(|index| {
                let shared = Arc::clone(&shared);
                thread::Builder::new()
                    .name(format!("headway-spin-{index}"))
                    .spawn(move || worker_loop(&shared, index))
                    .expect("spawning a spin-pool worker")
            })
            .collect();
        Self {
            shared,
            threads: handles.iter().map(|h| h.thread().clone()).collect(),
            handles,
            busy: std::sync::Mutex::new(()),
            jobs: AtomicUsize::new(0),
        }
    }

    /// Number of parts a job is split into (workers + the caller).
    pub fn parallelism(&self) -> usize {
        self.threads.len() + 1
    }

    /// Jobs [`Self::run`] has run since the pool was made: the fork-joins a forward costs are the
    /// difference across it.
    pub fn jobs(&self) -> usize {
        self.jobs.load(Ordering::Relaxed)
    }

    /// Calls `job(part)` for every part in `0..parallelism()`, part 0 on the calling thread, and
    /// returns when all have finished.
    pub fn run(&self, job: &(dyn Fn(usize) + Sync)) {
        self.jobs.fetch_add(1, Ordering::Relaxed);
        if self.threads.is_empty() {
            job(0);
            return;
        }
        let _one_at_a_time = self.busy.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the erased reference is dropped from `Shared` before this function returns, and
        // workers only call it while `pending > 0`, which we wait out below.
        let erased: *const (dyn Fn(usize) + Sync) = unsafe { std::mem::transmute(job) };
        *self.shared.job.lock().unwrap_or_else(|e| e.into_inner()) = Some(JobPtr(erased));
        self.shared
            .pending
            .store(self.threads.len(), Ordering::Release);
        // SeqCst on the generation bump and the `sleeping` loads (and on the worker's matching
        // store and re-check): with weaker orderings both sides can miss each other's write and a
        // worker parks through a published job.
        self.shared.generation.fetch_add(1, Ordering::SeqCst);
        for (thread, sleeping) in self.threads.iter().zip(&self.shared.sleeping) {
            if sleeping.load(Ordering::SeqCst) {
                thread.unpark();
            }
        }
        job(0);
        while self.shared.pending.load(Ordering::Acquire) != 0 {
            std::hint::spin_loop();
        }
        *self.shared.job.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
}

impl Drop for SpinPool {
    /// Stops and joins the workers (no job can be running: `run` borrows the pool).
    fn drop(&mut self) {
        self.shared.stopping.store(true, Ordering::SeqCst);
        for thread in &self.threads {
            thread.unpark();
        }
        for handle in self.handles.drain(..) {
            let _ = handle.join();
        }
    }
}

fn worker_loop(shared: &Shared, index: usize) {
    // Generation 0 is the state at construction; a job published before this thread first runs
    // has bumped it already and must still be picked up.
    let mut seen = 0;
    loop {
        let idle_since = Instant::now();
        let generation = loop {
            let current = shared.generation.load(Ordering::Acquire);
            if current != seen {
                break current;
            }
            if shared.stopping.load(Ordering::SeqCst) {
                return;
            }
            if idle_since.elapsed() < SPIN_BEFORE_PARK {
                std::hint::spin_loop();
                continue;
            }
            shared.sleeping[index].store(true, Ordering::SeqCst);
            // Re-check after announcing sleep so a job published meanwhile is not missed; park
            // may also return spuriously, which the loop absorbs.
            if shared.generation.load(Ordering::SeqCst) == seen {
                thread::park_timeout(Duration::from_millis(100));
            }
            shared.sleeping[index].store(false, Ordering::Release);
        };
        seen = generation;
        let job = *shared.job.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(JobPtr(job)) = job {
            // SAFETY: see `SpinPool::run`: the caller waits for `pending == 0` before the job's
            // borrow ends.
            unsafe { (*job)(index + 1) };
        }
        shared.pending.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_part_runs_exactly_once_per_job() {
        let pool = SpinPool::new(3);
        for round in 0..200 {
            let hits: Vec<AtomicUsize> = (0..3).map(|_| AtomicUsize::new(0)).collect();
            pool.run(&|part| {
                hits[part].fetch_add(1, Ordering::Relaxed);
            });
            let counts: Vec<usize> = hits.iter().map(|h| h.load(Ordering::Relaxed)).collect();
            assert_eq!(counts, vec![1, 1, 1], "round {round}");
        }
        assert_eq!(pool.jobs(), 200);
    }

    #[test]
    fn workers_wake_up_after_parking() {
        let pool = SpinPool::new(2);
        thread::sleep(SPIN_BEFORE_PARK * 3);
        let hits = AtomicUsize::new(0);
        pool.run(&|_| {
            hits.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(hits.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn a_single_thread_pool_runs_the_job_inline() {
        let pool = SpinPool::new(1);
        let hits = AtomicUsize::new(0);
        pool.run(&|part| {
            assert_eq!(part, 0);
            hits.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(hits.load(Ordering::Relaxed), 1);
    }
}
