//! Few-row products `x [rows, 576] · Wᵀ` over 30 quantised weights of 1536 × 576 (SmolLM2's MLP
//! shape; 576 × 1536, `ffn_down`'s, for formats whose rows are whole 256-value super-blocks),
//! one thread, per block format and instruction set: milliseconds, the rate the quantised bytes
//! stream at, and the time as a multiple of the roof — the slower of reading the bytes at the
//! rate one thread reads these very weights and of the multiply-accumulates at the kernel
//! instruction's measured peak (both printed; compare with the f32 row kernel:
//! `--example row_kernel`).
//!
//! cargo run --release -p headway-model --example quant_kernel [-- FORMAT...]
//! (formats by name, e.g. `Q4_1 Q8_0`; all of them without)
//!
//! Environment: `LAYERS` weights (default 30, 16.6 MB of Q4_1: in a large L3; 180 streams them
//! from memory), `SHAPE=down` for 576 × 1536 (`ffn_down`'s rows of 1,536) in every format.

#[path = "shared/timing.rs"]
mod timing;

use timing::best_of;

use headway_model::quant::{quantise, QuantFormat};
use headway_model::quant_kernel::{columns, int8_mac_rate, kernel_isa, Isa};
use headway_model::quant_kernel::{PackedMatrix, QuantisedRows};
use headway_model::roof::{read_rate, roofline_seconds};

const OUT: usize = 1536;
const IN: usize = 576;
const REPS: usize = 7;

fn main() {
    let layers: usize = match std::env::var("LAYERS") {
        Ok(v) => v.parse().expect("LAYERS: a number of weights"),
        Err(_) => 30,
    };
    let down = std::env::var("SHAPE").is_ok_and(|shape| shape == "down");
    let isas: Vec<Isa> = match kernel_isa() {
        Isa::Portable => vec![Isa::Portable],
        _ => Isa::all_available().split_off(1),
    };
    let mac_rates: Vec<f64> = isas.iter().map(|&isa| int8_mac_rate(isa)).collect();
    for (isa, rate) in isas.iter().zip(&mac_rates) {
        println!(
            "{isa:?}: peak {:.0} G int8 MACs/s on one thread",
            rate / 1e9
        );
    }
    println!("the kernels run {:?}", kernel_isa());
    let wanted: Vec<String> = std::env::args().skip(1).collect();
    let formats = QuantFormat::ALL
        .into_iter()
        .filter(|f| wanted.is_empty() || wanted.iter().any(|w| w == f.name()));
    for format in formats {
        let (out, inputs) = match IN % format.row_multiple() {
            0 if !down => (OUT, IN),
            _ => (IN, OUT),
        };
        let weights: Vec<PackedMatrix> = (0..layers)
            .map(|l| {
                let values: Vec<f32> = (0..out * inputs)
                    .map(|i| ((i * 7 + l) % 13) as f32 * 0.01 - 0.06)
                    .collect();
                PackedMatrix::new(&quantise(format, &values, out, inputs))
            })
            .collect();
        let regions: Vec<&[u8]> = weights.iter().map(|w| w.data()).collect();
        let bytes = (layers * weights[0].bytes()) as f64;
        let read = read_rate(1, &regions);
        println!(
            "{} [{out}, {inputs}] ({:.1} MB, read by one thread at {:.1} GB/s): rows, then ms \
             (GB/s, × roof) per instruction set {isas:?}",
            format.name(),
            bytes / 1e6,
            read / 1e9
        );
        for rows in [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 32, 64] {
            let x: Vec<f32> = (0..rows * inputs)
                .map(|i| (i % 5) as f32 * 0.1 - 0.2)
                .collect();
            let macs = (layers * rows * out * inputs) as f64;
            let mut y = vec![0f32; rows * out];
            let mut line = format!("{rows:>4}");
            for (&isa, &mac_rate) in isas.iter().zip(&mac_rates) {
                let seconds = best_of(REPS, || {
                    let quantised = QuantisedRows::new(&x, inputs);
                    for w in &weights {
                        // SAFETY: `isa` was detected; y holds rows × out floats.
                        unsafe { columns(isa, &quantised, w, y.as_mut_ptr(), out, 0, out) };
                    }
                });
                let roof = roofline_seconds(bytes, macs, read, mac_rate);
                line += &format!(
                    "  {:>7.2} ({:>5.1}, {:>4.2}×)",
                    seconds * 1e3,
                    bytes / seconds / 1e9,
                    seconds / roof
                );
            }
            println!("{line}");
        }
    }
}
