//! The C allocator's policy for large buffers, set once at the start of each binary.
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

/// glibc's initial threshold, held there.
const MMAP_THRESHOLD: usize = 128 * 1024;

/// Holds the allocator's mmap threshold at [`MMAP_THRESHOLD`], so that large buffers go back to
/// the system when freed, unless the user chose a threshold (`MALLOC_MMAP_THRESHOLD_`). A no-op
/// outside glibc.
pub fn return_large_buffers() {
    if std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_some() {
        return;
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes the allocator's parameters; any value is accepted or refused.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD as libc::c_int);
    }
}
