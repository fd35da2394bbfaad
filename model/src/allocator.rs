//! The C allocator's policy for large buffers: set once at the start of each binary, lifted
//! while a prefill runs.
//!
//! glibc serves a request of at least its mmap threshold with a mapping of its own, unmapped when
//! freed; smaller requests come from the heap, whose freed memory stays resident. The threshold
//! starts at 128 KiB but rises to the size of every mapped block that is freed (up to 32 MiB):
//! once loading has freed a few buffers of some megabytes (a checkpoint's dequantised tensors, a
//! fresh head's random parameters, the LM-head rows before they become a parameter), every later
//! buffer up to that size is served from the heap and, freed, stays resident. Measured on the
//! Q4_1 GGUF (`headway-serve bench --limit 8 --max-new-tokens 96 --threads 2`): plain decoding
//! ended at 562–572 MB resident against 492 MB with the threshold held at 128 KiB, and EAGLE-3
//! beside it at 641–654 MB against 544 MB, with decoding speed unchanged within the host's noise
//! (docs/benchmarks.md#heads-no-dense-copies).
//!
//! A prefill is the opposite case: each of its ops allocates buffers of megabytes (a 1,184-token
//! prompt's MLP activations are 7–15 MB) and frees them before the next layer asks again. Mapped,
//! every one is faulted in page by page and unmapped; from the heap, the first layer's buffers
//! serve all thirty. [`reuse_large_buffers`] lifts the threshold for such a forward and, once the
//! last one ends, puts it back and returns the freed memory: the 1,184-token prompt's prefill on
//! the Q4_1 GGUF took 1.8–2.1 s instead of 2.6 s (docs/benchmarks.md#prefill-buffers).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// glibc's initial threshold, held there.
const MMAP_THRESHOLD: usize = 128 * 1024;

/// The largest threshold glibc accepts on 64-bit hosts: while a prefill runs, every buffer up to
/// this size comes from the heap.
const PREFILL_MMAP_THRESHOLD: usize = 32 << 20;

/// Whether [`return_large_buffers`] holds the threshold (else the policy is the user's or
/// glibc's own, and [`reuse_large_buffers`] leaves it alone).
static HELD: AtomicBool = AtomicBool::new(false);

/// Forwards between a [`reuse_large_buffers`] and its guard's drop.
static REUSING: Mutex<usize> = Mutex::new(0);

/// Holds the allocator's mmap threshold at [`MMAP_THRESHOLD`], so that large buffers go back to
/// the system when freed, unless the user chose a threshold (`MALLOC_MMAP_THRESHOLD_`). A no-op
/// outside glibc.
pub fn return_large_buffers() {
    if std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_some() {
        return;
    }
    if set_thresholds(MMAP_THRESHOLD) {
        HELD.store(true, Ordering::SeqCst);
    }
}

/// Until the returned guard is dropped (and every other one taken meanwhile), buffers up to
/// [`PREFILL_MMAP_THRESHOLD`] come from the heap and stay there when freed, for the next op to
/// reuse; then the threshold goes back to [`MMAP_THRESHOLD`] and the heap's free memory back to
/// the system. Only where [`return_large_buffers`] holds the threshold; a no-op elsewhere.
pub fn reuse_large_buffers() -> ReusingLargeBuffers {
    if HELD.load(Ordering::SeqCst) {
        let mut reusing = REUSING.lock().unwrap_or_else(|e| e.into_inner());
        if *reusing == 0 {
            set_thresholds(PREFILL_MMAP_THRESHOLD);
        }
        *reusing += 1;
    }
    ReusingLargeBuffers {
        counted: HELD.load(Ordering::SeqCst),
    }
}

/// See [`reuse_large_buffers`].
#[must_use = "the heap is reused only while this guard lives"]
pub struct ReusingLargeBuffers {
    counted: bool,
}

impl Drop for ReusingLargeBuffers {
    fn drop(&mut self) {
        if !self.counted {
            return;
        }
        let mut reusing = REUSING.lock().unwrap_or_else(|e| e.into_inner());
        *reusing -= 1;
        if *reusing == 0 {
            set_thresholds(MMAP_THRESHOLD);
            // malloc_trim gives back the main heap's free top and every arena's free pages
            // inside; a thread's own arena gives back its free top only when a block of at
            // least 64 KiB beside it is freed, as this one is.
            drop(std::hint::black_box(Vec::<u8>::with_capacity(64 << 10)));
            #[cfg(all(target_os = "linux", target_env = "gnu"))]
            // SAFETY: malloc_trim only gives free heap pages back to the system.
            unsafe {
                libc::malloc_trim(0);
            }
        }
    }
}

/// Sets glibc's mmap threshold, and its trim threshold to the same size (a freed buffer at the
/// heap's top stays for the next one up to that size); whether glibc took it.
fn set_thresholds(bytes: usize) -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes the allocator's parameters; any value is accepted or refused.
    unsafe {
        let bytes = bytes as libc::c_int;
        libc::mallopt(libc::M_MMAP_THRESHOLD, bytes) == 1
            && libc::mallopt(libc::M_TRIM_THRESHOLD, bytes) == 1
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        let _ = bytes;
        false
    }
}
