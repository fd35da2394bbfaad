//! The allocator's policy: its own test binary, because it changes process-wide state and reads
//! process-wide counters (the tests here take turns through [`ONE_AT_A_TIME`]).

#![cfg(all(target_os = "linux", target_env = "gnu"))]

use std::sync::Mutex;

use headway_model::allocator::{return_large_buffers, reuse_large_buffers};

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Bytes glibc holds in mappings of their own.
fn mapped() -> usize {
    // SAFETY: mallinfo2 only reads the allocator's counters.
    unsafe { libc::mallinfo2() }.hblkhd
}

/// Whether a fresh 1 MiB buffer gets a mapping of its own.
fn a_megabyte_is_mapped() -> bool {
    let before = mapped();
    let buffer = std::hint::black_box(vec![1u8; 1 << 20]);
    let after = mapped();
    drop(buffer);
    after >= before + (1 << 20)
}

/// Once a 16 MiB block has been freed glibc would serve a 1 MiB request from the heap (its
/// threshold rises to the freed block's size); held at 128 KiB, the request gets a mapping of its
/// own, which goes back to the system when freed.
#[test]
fn large_buffers_get_mappings_of_their_own_after_a_larger_one_was_freed() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    return_large_buffers();
    drop(std::hint::black_box(vec![1u8; 16 << 20]));
    assert!(
        a_megabyte_is_mapped(),
        "a 1 MiB buffer was not mapped on its own"
    );
}

/// Resident bytes of this process.
fn resident() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("reading /proc/self/statm");
    let pages: usize = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    // SAFETY: sysconf only reads a system constant.
    pages * unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize
}

/// While a prefill holds the guard (two at once here), megabyte buffers come from the heap and
/// stay there when freed; once the last guard is dropped, the heap's freed memory goes back to
/// the system.
#[test]
fn large_buffers_come_from_the_heap_only_while_a_guard_lives() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    return_large_buffers();
    let outer = reuse_large_buffers();
    let inner = reuse_large_buffers();
    assert!(!a_megabyte_is_mapped(), "mapped while two guards live");
    drop(inner);
    // Fewer bytes than the trim threshold the guard sets: freeing them alone gives nothing back.
    let buffers: Vec<Vec<u8>> = (0..24).map(|i| vec![i as u8; 1 << 20]).collect();
    assert_eq!(std::hint::black_box(&buffers).len(), 24);
    drop(buffers);
    let kept = resident();
    drop(outer);
    let returned = kept.saturating_sub(resident());
    assert!(
        returned >= 16 << 20,
        "the guard's end gave back {returned} bytes of 24 freed MiB"
    );
}
