//! Attention of `new` query rows over a cache of `len` keys, SmolLM2's shapes (9 query heads over
//! 3 key/value heads of 64), 30 layers each with its own cache as a decoding step reads them:
//! Headway's row attention on one thread over an f32, f16 and bf16 cache (`--kv-dtype`) against
//! libtorch's `scaled_dot_product_attention` on one thread and on two (f32), with the tree-shaped
//! (causal) mask verification uses. Beside them, the bytes of the 30 caches and the rate at which
//! each of Headway's runs read them, and the compute roof: every row's f32 FMAs over every key
//! (its score and its weighted value, 2 × 9 heads × 64 features a layer) at the FMA rate one
//! thread of this host reaches.
//!
//! cargo run --release -p headway-model --example row_attention

#[path = "shared/timing.rs"]
mod timing;

use timing::best_of;

use headway_model::mask::causal_mask;
use headway_model::roof::f32_fma_rate;
use headway_model::row_attention::{self, KeyMask};
use headway_model::spin_pool::SpinPool;
use tch::{Device, Kind, Tensor};

const LAYERS: usize = 30;
const REPS: usize = 5;
const CACHE_KINDS: [Kind; 3] = [Kind::Float, Kind::Half, Kind::BFloat16];
/// f32 FMAs of one query row against one key over the layers: its score and its weighted value
/// for each of the 9 query heads of 64 features.
const FMAS_PER_ROW_AND_KEY: usize = LAYERS * 9 * 64 * 2;

/// Each layer's keys and values, `[1, 3, capacity, 64]`, in `kind`.
fn layer_caches(kind: Kind) -> Vec<(Tensor, Tensor)> {
    let options = (Kind::Float, Device::Cpu);
    (0..LAYERS)
        .map(|_| {
            let cache = || Tensor::randn([1, 3, 2048, 64], options).to_kind(kind);
            (cache(), cache())
        })
        .collect()
}

fn main() {
    let pool = SpinPool::new(1);
    let caches: Vec<Vec<(Tensor, Tensor)>> = CACHE_KINDS.into_iter().map(layer_caches).collect();
    let fma_rate = f32_fma_rate().expect("row attention runs only where AVX2 and FMA do");
    println!(
        "FMA roof: one thread's {:.1} G f32 FMAs/s\n\
         \x20 len  new   f32 ms (GB/s)   f16 ms (GB/s)  bf16 ms (GB/s)   FMA roof ms   sdpa 1 thread   sdpa 2 threads",
        fma_rate / 1e9
    );
    for len in [256i64, 1024, 2048] {
        let mut line = String::new();
        for new in [1i64, 8, 32, 64] {
            let queries = Tensor::randn([1, 9, new, 64], (Kind::Float, Device::Cpu));
            let mask = causal_mask(len as usize - new as usize, new as usize, Device::Cpu);
            let given = (new > 1).then_some(&mask);
            let view = |(k, v): &(Tensor, Tensor)| (k.narrow(2, 0, len), v.narrow(2, 0, len));
            let ours: Vec<String> = caches
                .iter()
                .map(|layers| {
                    let layers: Vec<(Tensor, Tensor)> = layers.iter().map(view).collect();
                    let seconds = best_of(REPS, || {
                        let mask = given.map_or(KeyMask::All, KeyMask::Given);
                        for (keys, values) in &layers {
                            let _ = row_attention::attend(&queries, keys, values, mask, &pool);
                        }
                    });
                    let bytes = layers
                        .iter()
                        .map(|(k, _)| (k.numel() * k.kind().elt_size_in_bytes()) * 2)
                        .sum::<usize>();
                    format!(
                        "{:>7.2} ({:>4.1})",
                        seconds * 1e3,
                        bytes as f64 / seconds / 1e9
                    )
                })
                .collect();
            let f32_layers: Vec<(Tensor, Tensor)> = caches[0].iter().map(view).collect();
            let sdpa = |threads| {
                tch::set_num_threads(threads);
                best_of(REPS, || {
                    for (keys, values) in &f32_layers {
                        let _ = Tensor::scaled_dot_product_attention(
                            &queries, keys, values, given, 0.0, false, None, true,
                        );
                    }
                })
            };
            let (one, two) = (sdpa(1), sdpa(2));
            let roof = (new * len) as f64 * FMAS_PER_ROW_AND_KEY as f64 / fma_rate;
            line += &format!(
                "{len:>5} {new:>4}   {}   {:>11.2}   {:>13.2}   {:>14.2}\n",
                ours.join("  "),
                roof * 1e3,
                one * 1e3,
                two * 1e3
            );
        }
        print!("{line}");
    }
}
