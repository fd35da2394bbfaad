//! Link settings every Headway crate that links libtorch needs, called from its `build.rs`.
//!
//! `torch-sys` tells only its direct dependents where libtorch lives
//! (`DEP_TCH_LIBTORCH_LIB`), and its own `-rpath` reaches the C++ shim, not our binaries.
//! Without this, binaries need `LD_LIBRARY_PATH`, and the linker's `--as-needed` drops
//! `libtorch_cuda` (nothing references it by symbol), so `tch::Cuda::is_available()` is false even
//! on a GPU. Crates calling [`emit`] must list `torch-sys` as a direct dependency.

use std::path::Path;

/// Prints the `cargo:` lines that give every target of the calling package an rpath to libtorch
/// and, when the torch build has CUDA, a `DT_NEEDED` entry for `libtorch_cuda`.
pub fn emit() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    let Ok(lib_dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
        println!(
            "cargo:warning=DEP_TCH_LIBTORCH_LIB is unset: add torch-sys as a direct \
             dependency; binaries will need LD_LIBRARY_PATH"
        );
        return;
    };
    println!("cargo:rustc-link-arg=-Wl,-rpath,{lib_dir}");
    if Path::new(&lib_dir).join("libtorch_cuda.so").exists() {
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-arg=-ltorch_cuda");
        println!("cargo:rustc-link-arg=-Wl,--as-needed");
    }
}
