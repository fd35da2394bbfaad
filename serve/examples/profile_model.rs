use headway_model::mask::positions;
use headway_model::{ForwardInput, KvCache, Target};
use std::time::Instant;
use tch::{Device, Kind, Tensor};

fn main() {
    let threads: i32 = std::env::args()
        .nth(1)
        .map(|s| s.parse().unwrap())
        .unwrap_or(2);
    headway_model::linear::set_cpu_inference_threads(threads as usize);
    let target = Target::load(
        std::path::Path::new("/tmp/smol-conv"),
        Kind::Float,
        Device::Cpu,
    )
    .unwrap();
    let _g = tch::no_grad_guard();
    let mut cache = KvCache::new(target.model.config(), 1, 600, Kind::Float, Device::Cpu).unwrap();
    let ids: Vec<i64> = (0..100).map(|i| 100 + i).collect();
    let input_ids = Tensor::from_slice(&ids).unsqueeze(0);
    let pos = positions(0, 100, Device::Cpu);
    let input = ForwardInput {
        input_ids: &input_ids,
        positions: &pos,
        mask: None,
        taps: &[],
    };
    let t = Instant::now();
    target
        .model
        .model
        .forward(&input, Some(&mut cache))
        .unwrap();
    println!(
        "prefill 100 tokens: {:.1} ms",
        t.elapsed().as_secs_f64() * 1e3
    );
    let n = 100;
    let (mut t_trunk, mut t_head) = (0.0, 0.0);
    for i in 0..n {
        let tok = Tensor::from_slice(&[5i64]).unsqueeze(0);
        let pos = positions(cache.len(), 1, Device::Cpu);
        let input = ForwardInput {
            input_ids: &tok,
            positions: &pos,
            mask: None,
            taps: &[],
        };
        let t = Instant::now();
        let h = target
            .model
            .model
            .forward(&input, Some(&mut cache))
            .unwrap()
            .hidden;
        let t1 = Instant::now();
        let logits = target.model.lm_head.forward(&h.get(0).get(0));
        let _ = logits.argmax(0, false).int64_value(&[]);
        let t2 = Instant::now();
        if i > 2 {
            t_trunk += (t1 - t).as_secs_f64();
            t_head += (t2 - t1).as_secs_f64();
        }
    }
    let m = (n - 3) as f64;
    println!(
        "threads {threads}: trunk {:.2} ms, head {:.2} ms, total {:.2} ms -> {:.1} tok/s",
        t_trunk / m * 1e3,
        t_head / m * 1e3,
        (t_trunk + t_head) / m * 1e3,
        m / (t_trunk + t_head)
    );
}
