//! A target's identity: a hash of what decides its hidden states, so features, heads and
//! checkpoints can be checked against the model they are used with.
//!
//! The fingerprint is SHA-256 over `config.json` and every weight file, each preceded by its name
//! and length (so moving bytes between files changes it). The directory's path is not part of
//! it: a copied or moved target keeps its fingerprint. A GGUF target's fingerprint is the same
//! hash over its one file (config, tokenizer and weights all live in it). The tokenizer and chat template are
//! recorded separately by the consumers that depend on them.
//!
//! A directory `convert` made from a GGUF records the GGUF's fingerprint beside its weights
//! ([`CONVERSION_RECORD_FILE`]), so that a head trained on the conversion can be served on the
//! file it came from and the other way round ([`TargetIdentity::kinship`]).

use std::io::Read;
use std::path::Path;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::files::write_bytes_atomically;
use crate::weights::weight_files;
use crate::{ModelError, Result};

/// The file `convert` writes into the directory it makes: which GGUF the weights came from.
pub const CONVERSION_RECORD_FILE: &str = "converted_from.json";

/// What `convert` records about the directory it wrote.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConversionRecord {
    /// The GGUF's file name (informational).
    pub source: String,
    /// The GGUF's fingerprint.
    pub source_fingerprint: String,
    /// The directory's fingerprint as written: the record speaks for the directory only while
    /// its config and weights are the ones converted.
    pub fingerprint: String,
}

/// Which target a head or its features were made on.
#[derive(Debug, Clone, PartialEq)]
pub struct TargetIdentity {
    /// [`target_fingerprint`].
    pub fingerprint: String,
    /// For a directory converted from a GGUF and not changed since, the GGUF's fingerprint.
    pub converted_from: Option<String>,
}

/// How two targets relate when a head made on one is used on the other.
#[derive(Debug, Clone, PartialEq)]
pub enum Kinship {
    /// The same weights.
    Same,
    /// The same GGUF, one side as its conversion (or both, in different conversions): the same
    /// model, whose hidden states differ in rounding only (a GGUF runs its blocks quantised,
    /// activations in int8). The text says which way round, for the user.
    SameSource(String),
}

impl TargetIdentity {
    /// How `served` relates to this target, the one a head was made on; `None` when they are
    /// different models.
    pub fn kinship(&self, served: &TargetIdentity) -> Option<Kinship> {
        if self.fingerprint == served.fingerprint {
            return Some(Kinship::Same);
        }
        let note = match (&self.converted_from, &served.converted_from) {
            (Some(source), _) if *source == served.fingerprint => {
                format!("made on the conversion of this GGUF ({})", self.fingerprint)
            }
            (_, Some(source)) if *source == self.fingerprint => {
                format!("made on the GGUF this directory was converted from ({source})")
            }
            (Some(a), Some(b)) if a == b => {
                format!(
                    "made on another conversion ({}) of the GGUF {a}",
                    self.fingerprint
                )
            }
            _ => return None,
        };
        Some(Kinship::SameSource(note))
    }
}

/// The identity of the target directory or GGUF file at `path`: its fingerprint and, where a
/// conversion record matches the directory as it is, the GGUF it was converted from.
pub fn target_identity(path: &Path) -> Result<TargetIdentity> {
    let fingerprint = target_fingerprint(path)?;
    let converted_from = match read_conversion_record(path)? {
        Some(record) if record.fingerprint == fingerprint => Some(record.source_fingerprint),
        Some(record) => {
            tracing::warn!(
                "{}: {CONVERSION_RECORD_FILE} describes other weights ({}) than the directory \
                 holds ({fingerprint}); ignoring it",
                path.display(),
                record.fingerprint
            );
            None
        }
        None => None,
    };
    Ok(TargetIdentity {
        fingerprint,
        converted_from,
    })
}

/// Records in `dir`, just converted from the GGUF file `gguf`, which file that was.
pub fn write_conversion_record(dir: &Path, gguf: &Path) -> Result<()> {
    let record = ConversionRecord {
        source: gguf
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        source_fingerprint: target_fingerprint(gguf)?,
        fingerprint: target_fingerprint(dir)?,
    };
    let path = dir.join(CONVERSION_RECORD_FILE);
    let text = serde_json::to_string_pretty(&record).map_err(|source| ModelError::Json {
        path: path.clone(),
        source,
    })?;
    write_bytes_atomically(&path, format!("{text}\n").as_bytes()).map(|_| ())
}

/// The conversion record of the directory `path`, if it has one (a GGUF file has none).
fn read_conversion_record(path: &Path) -> Result<Option<ConversionRecord>> {
    let record_path = path.join(CONVERSION_RECORD_FILE);
    if !path.is_dir() || !record_path.is_file() {
        return Ok(None);
    }
    let text =
        std::fs::read_to_string(&record_path).map_err(|e| ModelError::io(&record_path, e))?;
    crate::json::from_str_strict(&text)
        .map(Some)
        .map_err(|message| ModelError::Config {
            path: record_path,
            message,
        })
}

/// `sha256:<64 hex digits>` of the target directory `dir` or GGUF file (see the module docs).
/// Reads every weight byte once: about half a second for SmolLM2-135M in f32.
pub fn target_fingerprint(dir: &Path) -> Result<String> {
    let mut hasher = Sha256::new();
    let files = if dir.is_file() {
        vec![dir.to_path_buf()]
    } else {
        let mut files = vec![dir.join("config.json")];
        files.extend(weight_files(dir)?);
        files
    };
    for path in &files {
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
        hash_file(&mut hasher, path, name.as_deref().unwrap_or_default())?;
    }
    Ok(format!("sha256:{}", hex(&hasher.finalize())))
}

/// `sha256:<64 hex digits>` of the bytes of `path`.
pub fn file_sha256(path: &Path) -> Result<String> {
    let mut hasher = Sha256::new();
    copy_into(&mut hasher, path)?;
    Ok(format!("sha256:{}", hex(&hasher.finalize())))
}

/// `sha256:<64 hex digits>` of `bytes`.
pub fn bytes_sha256(bytes: &[u8]) -> String {
    format!("sha256:{}", hex(&Sha256::digest(bytes)))
}

fn hash_file(hasher: &mut Sha256, path: &Path, name: &str) -> Result<()> {
    let len = std::fs::metadata(path)
        .map_err(|e| ModelError::io(path, e))?
        .len();
    hasher.update((name.len() as u64).to_le_bytes());
    hasher.update(name.as_bytes());
    hasher.update(len.to_le_bytes());
    copy_into(hasher, path)
}

fn copy_into(hasher: &mut Sha256, path: &Path) -> Result<()> {
    let mut file = std::fs::File::open(path).map_err(|e| ModelError::io(path, e))?;
    let mut buffer = vec![0u8; 1 << 20];
    loop {
        let n = file
            .read(&mut buffer)
            .map_err(|e| ModelError::io(path, e))?;
        if n == 0 {
            return Ok(());
        }
        hasher.update(&buffer[..n]);
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::write_tiny_model;

    #[test]
    fn the_fingerprint_follows_weights_and_config_not_the_path() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        let c = tempfile::tempdir().unwrap();
        write_tiny_model(a.path(), 1).unwrap();
        write_tiny_model(b.path(), 1).unwrap();
        write_tiny_model(c.path(), 2).unwrap();
        let fa = target_fingerprint(a.path()).unwrap();
        assert!(fa.starts_with("sha256:") && fa.len() == 7 + 64, "{fa}");
        assert_eq!(fa, target_fingerprint(b.path()).unwrap());
        assert_ne!(fa, target_fingerprint(c.path()).unwrap());
        let config = b.path().join("config.json");
        let text = std::fs::read_to_string(&config).unwrap();
        std::fs::write(&config, text + "\n").unwrap();
        assert_ne!(fa, target_fingerprint(b.path()).unwrap());
    }

    /// A conversion record ties a directory to its GGUF while the directory's weights are the
    /// ones converted, and kinship runs both ways; an unrelated model is no kin.
    #[test]
    fn a_conversion_is_kin_to_its_source_while_unchanged() {
        let dir = tempfile::tempdir().unwrap();
        let (conversion, other) = (dir.path().join("conversion"), dir.path().join("other"));
        write_tiny_model(&conversion, 1).unwrap();
        write_tiny_model(&other, 2).unwrap();
        let gguf = dir.path().join("model.gguf");
        std::fs::write(&gguf, b"stands in for a GGUF").unwrap();
        write_conversion_record(&conversion, &gguf).unwrap();
        let converted = target_identity(&conversion).unwrap();
        let file = target_identity(&gguf).unwrap();
        assert_eq!(converted.converted_from.as_ref(), Some(&file.fingerprint));
        assert_eq!(file.converted_from, None);
        assert!(matches!(
            converted.kinship(&file),
            Some(Kinship::SameSource(_))
        ));
        assert!(matches!(
            file.kinship(&converted),
            Some(Kinship::SameSource(_))
        ));
        assert_eq!(file.kinship(&file), Some(Kinship::Same));
        let unrelated = target_identity(&other).unwrap();
        assert_eq!(unrelated.kinship(&file), None);
        assert_eq!(file.kinship(&unrelated), None);
        // A second conversion of the same file is kin to the first.
        let mut second = unrelated.clone();
        second.converted_from = Some(file.fingerprint.clone());
        assert!(matches!(
            second.kinship(&converted),
            Some(Kinship::SameSource(_))
        ));
        // Weights changed after the conversion: the record no longer speaks for them.
        let config = conversion.join("config.json");
        let text = std::fs::read_to_string(&config).unwrap();
        std::fs::write(&config, text + "\n").unwrap();
        assert_eq!(target_identity(&conversion).unwrap().converted_from, None);
        // A record that does not parse is named.
        std::fs::write(conversion.join(CONVERSION_RECORD_FILE), "{").unwrap();
        let error = target_identity(&conversion).unwrap_err().to_string();
        assert!(error.contains(CONVERSION_RECORD_FILE), "{error}");
    }
}
