//! Build-script helpers for every Headway crate that links libtorch: link settings, and C++ shims
//! compiled against its headers.
//!
//! `torch-sys` tells only its direct dependents where libtorch lives
//! (`DEP_TCH_LIBTORCH_LIB`), and its own `-rpath` reaches the C++ shim, not our binaries.
//! Without this, binaries need `LD_LIBRARY_PATH`, and the linker's `--as-needed` drops
//! `libtorch_cuda` (nothing references it by symbol), so `tch::Cuda::is_available()` is false even
//! on a GPU. Crates calling [`emit`] or [`compile_cpp`] must list `torch-sys` as a direct
//! dependency.

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

/// Compiles the C++ `sources` against libtorch's headers (and the package's own `includes`
/// directories, searched first) into the static library `name`, linked into the calling package.
/// For the few ATen entry points `tch` does not wrap; keep such code to plain C functions that
/// catch every exception.
pub fn compile_cpp(name: &str, sources: &[&str], includes: &[&str]) {
    for path in sources.iter().chain(includes) {
        println!("cargo:rerun-if-changed={path}");
    }
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    let lib_dir = std::env::var("DEP_TCH_LIBTORCH_LIB")
        .expect("DEP_TCH_LIBTORCH_LIB is unset: add torch-sys as a direct dependency");
    let include = Path::new(&lib_dir).join("../include");
    // PyPI's torch (2.7 on) and libtorch's cxx11 builds both use the new ABI.
    let abi = std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".to_owned());
    cc::Build::new()
        .cpp(true)
        .files(sources)
        .includes(includes)
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={abi}"))
        .flag("-DGLOG_USE_GLOG_EXPORT")
        .warnings(false)
        .compile(name);
}
