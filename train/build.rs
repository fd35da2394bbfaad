use std::path::Path;

fn main() {
    libtorch_link::emit();
    libtorch_link::compile_cpp("headway_autocast", &["csrc/autocast.cpp"], &[]);
    // c10d's Gloo process group; see csrc/gloo_declarations/gloo/context.h for why the
    // declarations are Headway's.
    println!("cargo:rerun-if-changed=csrc/distributed.hpp");
    libtorch_link::compile_cpp(
        "headway_distributed",
        &["csrc/distributed.cpp"],
        &["csrc/gloo_declarations"],
    );
    // c10d's NCCL process group, where libtorch has CUDA and CUDA's headers are found.
    println!("cargo:rustc-check-cfg=cfg(headway_nccl)");
    match nccl_includes() {
        Ok(Some(includes)) => {
            let includes: Vec<&str> = includes.iter().map(String::as_str).collect();
            libtorch_link::compile_cpp(
                "headway_distributed_nccl",
                &["csrc/distributed_nccl.cpp"],
                &includes,
            );
            println!("cargo:rustc-cfg=headway_nccl");
        }
        Ok(None) => {}
        Err(missing) => println!(
            "cargo:warning=data-parallel training over NCCL not built: libtorch has CUDA but \
             these headers were not found: {missing} (`make venv` installs them; or set \
             CUDA_HOME to a CUDA toolkit). Gloo remains."
        ),
    }
}

/// Headers that c10d's NCCL process group includes besides libtorch's own, and what provides
/// them (PyPI wheels, or a CUDA toolkit).
const CUDA_HEADERS: [(&str, &str); 4] = [
    (
        "cuda_runtime_api.h",
        "the CUDA runtime (nvidia-cuda-runtime)",
    ),
    ("crt/host_config.h", "CUDA's crt headers (nvidia-cuda-crt)"),
    ("nv/target", "CCCL (nvidia-cuda-cccl)"),
    ("nccl.h", "NCCL (nvidia-nccl)"),
];

/// The include directories c10d's NCCL headers need, when libtorch was built with CUDA: `Ok`
/// with them when every header is found (in `$CUDA_HOME/include`, `/usr/local/cuda/include` or
/// the `nvidia/*/include` directories of the PyPI wheels beside torch), `Err` naming what is
/// missing, `Ok(None)` for a CPU-only libtorch.
fn nccl_includes() -> Result<Option<Vec<String>>, String> {
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    let lib_dir = std::env::var("DEP_TCH_LIBTORCH_LIB")
        .expect("DEP_TCH_LIBTORCH_LIB is unset: torch-sys is a direct dependency");
    if !Path::new(&lib_dir).join("libtorch_cuda.so").exists() {
        return Ok(None);
    }
    let mut candidates: Vec<std::path::PathBuf> = std::env::var("CUDA_HOME")
        .into_iter()
        .map(|home| Path::new(&home).join("include"))
        .chain([Path::new("/usr/local/cuda/include").to_path_buf()])
        .collect();
    // PyPI's torch lives in site-packages/torch/lib, CUDA's wheels in site-packages/nvidia: a
    // wheel installed later reruns this.
    let wheels = Path::new(&lib_dir).join("../../nvidia");
    if let Ok(entries) = std::fs::read_dir(&wheels) {
        println!("cargo:rerun-if-changed={}", wheels.display());
        let mut found: Vec<_> = entries
            .flatten()
            .map(|e| e.path().join("include"))
            .collect();
        found.sort();
        candidates.extend(found);
    }
    let mut includes = Vec::new();
    let mut missing = Vec::new();
    for (header, provider) in CUDA_HEADERS {
        match candidates.iter().find(|dir| dir.join(header).exists()) {
            Some(dir) => {
                let dir = dir.display().to_string();
                if !includes.contains(&dir) {
                    includes.push(dir);
                }
            }
            None => missing.push(format!("{header} ({provider})")),
        }
    }
    match missing.is_empty() {
        true => Ok(Some(includes)),
        false => Err(missing.join(", ")),
    }
}
