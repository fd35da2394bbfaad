//! Timing shared by the kernel examples.

use std::time::Instant;

/// The fastest of `reps` runs of `run`, in seconds.
pub fn best_of(reps: usize, mut run: impl FnMut()) -> f64 {
    (0..reps)
        .map(|_| {
            let start = Instant::now();
            run();
            start.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}
