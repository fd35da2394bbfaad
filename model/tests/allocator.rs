//! The allocator's policy: its own test binary, because it changes process-wide state and reads
//! process-wide counters.

/// Once a 16 MiB block has been freed glibc would serve a 1 MiB request from the heap (its
/// threshold rises to the freed block's size); held at 128 KiB, the request gets a mapping of its
/// own, which goes back to the system when freed.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn large_buffers_get_mappings_of_their_own_after_a_larger_one_was_freed() {
    headway_model::allocator::return_large_buffers();
    let mapped = || unsafe { libc::mallinfo2() }.hblkhd;
    drop(std::hint::black_box(vec![1u8; 16 << 20]));
    let before = mapped();
    let buffer = std::hint::black_box(vec![1u8; 1 << 20]);
    let after = mapped();
    drop(buffer);
    assert!(
        after >= before + (1 << 20),
        "a 1 MiB buffer was not mapped on its own: mapped bytes {before} -> {after}"
    );
}
