//! Few-row products `x [rows, 576] · Wᵀ` over 30 weights of 1536 × 576 (SmolLM2's MLP shape), one
//! thread: Headway's row-streaming kernel against the `gemm` crate, by number of rows. This is
//! what decides `ROW_KERNEL_MAX_ROWS` in `linear.rs`.
//!
//! cargo run --release -p headway-model --example row_kernel

#[path = "shared/timing.rs"]
mod timing;

use timing::best_of;

use headway_model::linear::gemm_columns;
use headway_model::row_kernel::{self, Product};

const OUT: usize = 1536;
const IN: usize = 576;
const LAYERS: usize = 30;
const REPS: usize = 7;

fn main() {
    if !row_kernel::available() {
        eprintln!("this CPU lacks AVX2 + FMA: the row kernel is not used here");
        return;
    }
    let weights: Vec<Vec<f32>> = (0..LAYERS)
        .map(|l| {
            (0..OUT * IN)
                .map(|i| ((i * 7 + l) % 13) as f32 * 0.01)
                .collect()
        })
        .collect();
    let bytes = (LAYERS * OUT * IN * 4) as f64;
    println!("rows  row kernel ms (GB/s)   gemm ms (GB/s)");
    for rows in [1, 2, 3, 4, 6, 8, 13, 16, 20, 24, 32] {
        let x: Vec<f32> = (0..rows * IN).map(|i| (i % 5) as f32 * 0.1).collect();
        let mut y = vec![0f32; rows * OUT];
        let product = Product {
            rows,
            in_features: IN,
            y_stride: OUT,
        };
        let streamed = best_of(REPS, || {
            for w in &weights {
                // SAFETY: the kernel is available; x, w and y hold the sizes `product` names.
                unsafe {
                    row_kernel::columns(x.as_ptr(), w.as_ptr(), y.as_mut_ptr(), product, 0, OUT)
                };
            }
        });
        let packed = best_of(REPS, || {
            for w in &weights {
                // SAFETY: as above.
                unsafe { gemm_columns(x.as_ptr(), w.as_ptr(), y.as_mut_ptr(), product, 0, OUT) };
            }
        });
        println!(
            "{rows:>4}  {:>8.2} ({:>5.1})        {:>8.2} ({:>5.1})",
            streamed * 1e3,
            bytes / streamed / 1e9,
            packed * 1e3,
            bytes / packed / 1e9
        );
    }
}
