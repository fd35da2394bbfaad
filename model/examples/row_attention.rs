//! Attention of `new` query rows over a cache of `len` keys, SmolLM2's shapes (9 query heads over
//! 3 key/value heads of 64), 30 layers' worth: Headway's row attention on 2 spinning threads
//! (what decoding and verification run) against libtorch's `scaled_dot_product_attention` on one
//! thread (what they ran before) and on two, with the tree-shaped (causal) mask verification uses.
//!
//! cargo run --release -p headway-model --example row_attention

#[path = "shared/timing.rs"]
mod timing;

use timing::best_of;

use headway_model::mask::causal_mask;
use headway_model::row_attention::{self, KeyMask};
use headway_model::spin_pool::SpinPool;
use tch::{Device, Kind, Tensor};

const LAYERS: usize = 30;
const REPS: usize = 5;

fn main() {
    let pool = SpinPool::new(1);
    let options = (Kind::Float, Device::Cpu);
    println!("  len  new   row attention ms   sdpa 1 thread ms   sdpa 2 threads ms");
    for len in [256, 1024] {
        let cache = [
            Tensor::randn([1, 3, 2048, 64], options),
            Tensor::randn([1, 3, 2048, 64], options),
        ];
        let (keys, values) = (cache[0].narrow(2, 0, len), cache[1].narrow(2, 0, len));
        for new in [1, 8, 32, 64] {
            let queries = Tensor::randn([1, 9, new, 64], options);
            let mask = causal_mask(len as usize - new as usize, new as usize, Device::Cpu);
            let given = (new > 1).then_some(&mask);
            let ours = best_of(REPS, || {
                let mask = given.map_or(KeyMask::All, KeyMask::Given);
                for _ in 0..LAYERS {
                    let _ = row_attention::attend(&queries, &keys, &values, mask, &pool);
                }
            });
            let sdpa = |threads| {
                tch::set_num_threads(threads);
                best_of(REPS, || {
                    for _ in 0..LAYERS {
                        let _ = Tensor::scaled_dot_product_attention(
                            &queries, &keys, &values, given, 0.0, false, None, true,
                        );
                    }
                })
            };
            let (one, two) = (sdpa(1), sdpa(2));
            println!(
                "{len:>5} {new:>4}   {:>16.2}   {:>16.2}   {:>17.2}",
                ours * 1e3,
                one * 1e3,
                two * 1e3
            );
        }
    }
}
