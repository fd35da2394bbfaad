//! The embedded default's GGUF run as stored (Q4_1 layers, Q8_0 embeddings and LM head): what it
//! matches, and that speculative decoding on it stays lossless.

use headway_model::testing::{real_gguf_path, reference_logits};
use headway_model::{CpuThreads, ForwardInput, KvCache, TreeInput};
use headway_tests::{run, stderr, stdout};
use tch::{Device, Kind};

/// Against transformers' logits for the dequantised weights (the fixture the f32 path matches
/// within 1e-3): the quantised kernels round activations to 8 bits per 32-value block, and over
/// 30 layers that moves logits by 0.21 on average and 1.93 at worst (over 38 positions × 49,152
/// logits; SmolLM2's residual stream has outlier channels, which coarsen the other 31 values of
/// their block), and the top token at 2 of 38 positions.
#[test]
fn logits_stay_close_to_the_dequantised_model_and_keep_its_top_token() {
    let target = headway_gguf::open_target(
        &real_gguf_path(),
        Kind::Float,
        Device::Cpu,
        CpuThreads::new(2),
    )
    .expect("open the GGUF");
    let cpu = target.cpu.decode();
    let _no_grad = tch::no_grad_guard();
    let (mut worst, mut total, mut positions, mut same_top) = (0f64, 0f64, 0i64, 0i64);
    for (ids, expected) in reference_logits() {
        let mut cache = KvCache::new(
            target.model.config(),
            1,
            ids.len(),
            target.kind,
            target.device,
        )
        .unwrap();
        let tokens = TreeInput::causal(0, &ids, Device::Cpu);
        let input = ForwardInput::new(&tokens, &[], &cpu);
        let hidden = target
            .model
            .model
            .forward(&input, Some(&mut cache))
            .unwrap()
            .hidden;
        let logits = target.model.lm_head.forward(&hidden.squeeze_dim(0), &cpu);
        let deviation = (&logits - &expected).abs();
        worst = worst.max(deviation.max().double_value(&[]));
        total += deviation.mean(Kind::Float).double_value(&[]) * ids.len() as f64;
        positions += ids.len() as i64;
        same_top += logits
            .argmax(-1, false)
            .eq_tensor(&expected.argmax(-1, false))
            .sum(Kind::Int64)
            .int64_value(&[]);
    }
    let mean = total / positions as f64;
    eprintln!(
        "|Δ logit| worst {worst:.3}, mean {mean:.4}; top token kept at {same_top} of {positions}"
    );
    assert!(positions >= 30, "the fixture holds the prompts");
    assert!(
        worst < 2.5 && mean < 0.3,
        "logits off by {worst} at worst, {mean} on average"
    );
    assert!(
        same_top as f64 >= 0.9 * positions as f64,
        "{same_top} of {positions}"
    );
}

/// Greedy output on the GGUF is the same with and without prompt-lookup drafting (trees verified
/// on the quantised kernels give decoding's bits).
#[test]
fn lookup_drafting_on_the_gguf_equals_its_plain_greedy_decoding() {
    let gguf = real_gguf_path();
    let answer = |method: &str| {
        let out = run(
            "headway-serve",
            &[
                "generate",
                "--target",
                gguf.to_str().unwrap(),
                "--threads",
                "2",
                "--chat",
                "--prompt",
                "List the planets of the solar system, one per line, then list them again.",
                "--max-new-tokens",
                "96",
                "--method",
                method,
            ],
        );
        assert!(out.status.success(), "{method}: {}", stderr(&out));
        (stdout(&out), stderr(&out))
    };
    let (plain, _) = answer("ar");
    let (drafted, report) = answer("lookup");
    assert_eq!(
        drafted, plain,
        "lookup drafting changed the output ({report})"
    );
    assert!(plain.contains("Mars"), "{plain}");
}
