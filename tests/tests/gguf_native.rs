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

/// `headway-serve generate` on the GGUF, greedy, 96 new tokens with `method` and `extra` flags:
/// (stdout, stderr), or the failure's stderr.
fn generate_on_the_gguf(method: &str, extra: &[&str]) -> Result<(String, String), String> {
    let gguf = real_gguf_path();
    let mut args = vec![
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
    ];
    args.extend_from_slice(extra);
    let out = run("headway-serve", &args);
    match out.status.success() {
        true => Ok((stdout(&out), stderr(&out))),
        false => Err(stderr(&out)),
    }
}

/// Greedy output on the GGUF is the same with and without prompt-lookup drafting (trees verified
/// on the quantised kernels give decoding's bits).
#[test]
fn lookup_drafting_on_the_gguf_equals_its_plain_greedy_decoding() {
    let (plain, _) = generate_on_the_gguf("ar", &[]).expect("ar");
    let (drafted, report) = generate_on_the_gguf("lookup", &[]).expect("lookup");
    assert_eq!(
        drafted, plain,
        "lookup drafting changed the output ({report})"
    );
    assert!(plain.contains("Mars"), "{plain}");
}

/// The GGUF's own fingerprint, which a head made on it (or on its conversion, as
/// `converted_from`) names.
const GGUF_FINGERPRINT: &str =
    "sha256:47586659775f81015dc34874c0880be525f1d960b86c1015523edb3b95a0afcd";

/// The committed head `name`'s config.json.
fn committed_head_config(name: &str) -> serde_json::Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../pretrained")
        .join(name)
        .join("config.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The committed heads were made on the GGUF or on its conversion: they serve on the GGUF itself
/// (the loader says when it was the conversion), and their trees, verified on the quantised
/// kernels, leave greedy output unchanged, with lookup's chain grafted on too.
#[test]
fn committed_heads_serve_on_the_gguf_and_keep_its_greedy_output() {
    let (plain, _) = generate_on_the_gguf("ar", &[]).expect("ar");
    let pretrained = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../pretrained");
    for (method, head) in [
        ("eagle", "smollm2-135m-eagle"),
        ("eagle3", "smollm2-135m-eagle3"),
    ] {
        let made_on_the_gguf =
            committed_head_config(head)["target"]["fingerprint"] == GGUF_FINGERPRINT;
        let heads = pretrained.join(head);
        let heads = heads.to_str().unwrap();
        for lookup in [&[][..], &["--with-lookup"][..]] {
            let flags = [&["--heads", heads, "--tree-tokens", "8"][..], lookup].concat();
            let (drafted, report) = generate_on_the_gguf(method, &flags)
                .unwrap_or_else(|e| panic!("{method} {lookup:?} refused: {e}"));
            assert_eq!(
                drafted, plain,
                "{method} {lookup:?} changed the output ({report})"
            );
            assert_eq!(
                report.contains("made on the conversion of this GGUF"),
                !made_on_the_gguf,
                "{method}: the loader names the conversion when the head was made on it \
                 ({report})"
            );
        }
    }
}

/// A head for another model is still refused on the GGUF, naming both fingerprints.
#[test]
fn a_head_for_another_model_is_refused_on_the_gguf_naming_both() {
    let dir = tempfile::tempdir().unwrap();
    let head =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../pretrained/smollm2-135m-eagle3");
    let foreign = dir.path().join("head");
    std::fs::create_dir(&foreign).unwrap();
    std::fs::copy(
        head.join("model.safetensors"),
        foreign.join("model.safetensors"),
    )
    .unwrap();
    let mut config = committed_head_config("smollm2-135m-eagle3");
    let target = &config["target"];
    assert!(
        target["fingerprint"] == GGUF_FINGERPRINT || target["converted_from"] == GGUF_FINGERPRINT,
        "the committed head names the GGUF: {target}"
    );
    let other = format!("sha256:{}", "ab".repeat(32));
    config["target"]["fingerprint"] = other.clone().into();
    config["target"]["converted_from"] = serde_json::Value::Null;
    std::fs::write(foreign.join("config.json"), config.to_string()).unwrap();
    let error = generate_on_the_gguf("eagle3", &["--heads", foreign.to_str().unwrap()])
        .expect_err("a head for another model");
    assert!(
        error.contains(&other) && error.contains(GGUF_FINGERPRINT),
        "names the head's target and the GGUF: {error}"
    );
}
