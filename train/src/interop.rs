//! `export` / `import`: head checkpoints in the layouts other tools load.
//!
//! - Medusa (the Medusa repository): `config.json` with `medusa_num_heads`, `medusa_num_layers`
//!   and `base_model_name_or_path`, and `medusa_lm_head.safetensors` with `{k}.{l}.linear.weight`,
//!   `{k}.{l}.linear.bias` and each head's LM head `{k}.{L}.weight` (a shared LM head is written
//!   out per head, as that format has no shared one).
//! - EAGLE (EAGLE repository, vLLM, SGLang): `config.json`, the target's Llama config with one
//!   layer, and `model.safetensors` with `fc.*` and `layers.0.*`; a draft vocabulary adds
//!   EAGLE-3's `d2t` (draft index → target id offset, `target = i + d2t[i]`) and `t2d` (bool mask
//!   over the target vocabulary) with `draft_vocab_size` in the config. A head's embedding scale
//!   is folded into `fc.weight`'s embedding columns, so the exported head computes the same.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::Context;
use headway_checkpoints::{CheckpointConfig, HeadKind, TargetRef, CHECKPOINT_FORMAT};
use headway_heads::eagle::fold_embed_scale;
use headway_heads::{EagleConfig, MedusaConfig};
use headway_model::fingerprint::target_fingerprint;
use headway_model::safetensors_io::{from_safetensors_bytes, to_safetensors_bytes};
use headway_model::{ModelConfig, SafetensorsWeights};
use tch::{Device, Kind, Tensor};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Medusa,
    Eagle,
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
    let mut weights = SafetensorsWeights::open(dir, Kind::Float, Device::Cpu)?;
    let name = if config.tie_word_embeddings {
        "model.embed_tokens.weight"
    } else {
        "lm_head.weight"
    };
    Ok(headway_model::WeightSource::tensor(
        &mut weights,
        name,
        &[config.vocab_size as i64, config.hidden_size as i64],
    )?)
}

pub fn run_export(args: ExportArgs) -> anyhow::Result<()> {
    let checkpoint = headway_checkpoints::load(&args.heads)?;
    let target = target_dir(&args.target);
    checkpoint.check_target(&target_fingerprint(&target)?)?;
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let mut tensors: Vec<(String, Tensor)> = checkpoint
        .weights
        .iter()
        .map(|(n, t)| (n.clone(), t.shallow_clone()))
        .collect();
    let config = match (&checkpoint.config.head, args.format) {
        (HeadKind::Medusa(medusa), Format::Medusa) => {
            anyhow::ensure!(
                checkpoint.config.draft_vocab.is_none(),
                "the Medusa repository's format has no draft vocabulary; train without --draft-vocab to export"
            );
            if medusa.shared_lm_head {
                let lm_head = target_lm_head(&target)?;
                for k in 0..medusa.num_heads {
                    tensors.push((
                        format!("{k}.{}.weight", medusa.num_layers),
                        lm_head.shallow_clone(),
                    ));
                }
            }
            tensors.sort_by(|a, b| a.0.cmp(&b.0));
            let path = args.out.join("medusa_lm_head.safetensors");
            write(&path, &to_safetensors_bytes(&tensors, None, &path)?)?;
            serde_json::json!({
                "medusa_num_heads": medusa.num_heads,
                "medusa_num_layers": medusa.num_layers,
                "hidden_size": medusa.hidden_size,
                "vocab_size": medusa.vocab_size,
                "base_model_name_or_path": checkpoint.config.target.dir,
                "headway_target_fingerprint": checkpoint.config.target.fingerprint,
            })
        }
        (HeadKind::Eagle { taps, .. }, Format::Eagle) if !taps.is_empty() => anyhow::bail!(
            "{} fuses the target's taps {taps:?} into its input, which the EAGLE repository's layout has no place for; only untapped heads export",
            checkpoint.dir.display()
        ),
        (
            HeadKind::Eagle {
                layers,
                embed_scale,
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
            let text = std::fs::read_to_string(target.join("config.json"))?;
            let mut config: serde_json::Value = serde_json::from_str(&text)?;
            config["num_hidden_layers"] = (*layers).into();
            config["headway_target_fingerprint"] =
                checkpoint.config.target.fingerprint.clone().into();
            if let Some(d2t) = &checkpoint.config.draft_vocab {
                config["draft_vocab_size"] = d2t.len().into();
                let offsets: Vec<i64> = d2t
                    .iter()
                    .enumerate()
                    .map(|(i, &t)| i64::from(t) - i as i64)
                    .collect();
                let mut t2d = vec![false; checkpoint.config.target.vocab_size];
                for &t in d2t {
                    t2d[t as usize] = true;
                }
                tensors.push(("d2t".into(), Tensor::from_slice(&offsets)));
                tensors.push(("t2d".into(), Tensor::from_slice(&t2d)));
            }
            tensors.sort_by(|a, b| a.0.cmp(&b.0));
            let path = args.out.join("model.safetensors");
            write(&path, &to_safetensors_bytes(&tensors, None, &path)?)?;
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
            let weights = read_tensors(&args.from.join("medusa_lm_head.safetensors"))?;
            let (num_heads, num_layers) = (field("medusa_num_heads")?, field("medusa_num_layers")?);
            let lm_head = weights
                .get(&format!("0.{num_layers}.weight"))
                .with_context(|| {
                    format!("medusa_lm_head.safetensors has no 0.{num_layers}.weight")
                })?;
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
            let mut weights = read_tensors(&args.from.join("model.safetensors"))?;
            weights.remove("t2d");
            let draft_vocab = match weights.remove("d2t") {
                Some(offsets) => {
                    let offsets = Vec::<i64>::try_from(&offsets.to_kind(Kind::Int64))?;
                    Some(
                        offsets
                            .iter()
                            .enumerate()
                            .map(|(i, &o)| (i as i64 + o) as u32)
                            .collect(),
                    )
                }
                None => None,
            };
            // The EAGLE repository's and vLLM's draft configs give the layer count here.
            let layers = field("num_hidden_layers")?;
            anyhow::ensure!(
                layers > 0,
                "{}: num_hidden_layers is 0; an EAGLE head has at least one layer",
                config_path.display()
            );
            let head = HeadKind::Eagle {
                layers,
                taps: vec![],
                embed_scale: 1.0,
            };
            (head, weights, draft_vocab)
        }
    };
    let expected = match &head {
        HeadKind::Medusa(medusa) => medusa.parameter_shapes(),
        HeadKind::Eagle { layers, .. } => headway_heads::eagle::parameter_shapes(
            &EagleConfig::for_target(&target_config, *layers),
        )?,
    };
    check_tensors(&args.from, &weights, &expected)?;
    for tensor in weights.values_mut() {
        *tensor = tensor.to_kind(Kind::Float);
    }
    let checkpoint = CheckpointConfig {
        format: CHECKPOINT_FORMAT.to_string(),
        head,
        target: TargetRef {
            fingerprint: target_fingerprint(&target)?,
            dir: target.display().to_string(),
            hidden_size: target_config.hidden_size,
            vocab_size: target_config.vocab_size,
        },
        draft_vocab,
        step: 0,
        weights_sha256: String::new(),
    };
    let tensors: Vec<(String, Tensor)> = weights.into_iter().collect();
    let dir = headway_checkpoints::save(&args.out, &checkpoint, &tensors, None)?;
    println!("imported {} → {}", args.from.display(), dir.display());
    Ok(())
}
