//! Measures how fast one-row products stream f32 weights from memory: libtorch's `linear` versus
//! Headway's CPU inference path (`headway_model::linear`). The reason the latter exists; run with
//! `cargo run --release -p headway-model --example linear_bandwidth -- [threads]`.

use std::time::Instant;

use headway_model::linear::Linear;
use headway_model::CpuThreads;
use tch::{Device, Kind, Tensor};

/// 40 matrices of SmolLM2's gate/up size (3072 × 576 f32, 7 MB each): 283 MB, far beyond any cache.
const MATRICES: usize = 40;

fn gigabytes_per_second(label: &str, bytes: f64, mut product: impl FnMut()) {
    product();
    let rounds = 10;
    let start = Instant::now();
    for _ in 0..rounds {
        product();
    }
    let seconds = start.elapsed().as_secs_f64() / rounds as f64;
    println!(
        "{label:44} {:6.2} ms  {:5.1} GB/s",
        seconds * 1e3,
        bytes / seconds / 1e9
    );
}

fn main() {
    let threads = std::env::args()
        .nth(1)
        .map_or(2, |t| t.parse().expect("threads: a number"));
    let _no_grad = tch::no_grad_guard();
    let opts = (Kind::Float, Device::Cpu);
    let weights: Vec<Tensor> = (0..MATRICES)
        .map(|_| Tensor::randn([3072, 576], opts))
        .collect();
    let bytes = (MATRICES * 3072 * 576 * 4) as f64;
    let x = Tensor::randn([1, 576], opts);
    let all = Tensor::cat(&weights, 0);
    gigabytes_per_second("memory read (sum over all weights)", bytes, || {
        let _ = all.sum(Kind::Float);
    });
    tch::set_num_threads(threads as i32);
    gigabytes_per_second(
        &format!("libtorch linear, 1 row, {threads} threads"),
        bytes,
        || {
            for w in &weights {
                let _ = x.linear::<Tensor>(w, None);
            }
        },
    );
    let cpu = CpuThreads::new(threads).decode();
    cpu.enter();
    let layers: Vec<Linear> = weights
        .iter()
        .map(|w| Linear::new(w.shallow_clone(), None))
        .collect();
    gigabytes_per_second(
        &format!("headway split gemm, 1 row, {threads} threads"),
        bytes,
        || {
            for layer in &layers {
                let _ = layer.forward(&x, &cpu);
            }
        },
    );
}
