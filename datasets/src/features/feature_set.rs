//! Reading a finished feature directory: the manifest, the target check, and shards verified
//! against their checksums before use.

use std::path::{Path, PathBuf};

use headway_model::fingerprint::{bytes_sha256, file_sha256};

use crate::error::{DatasetError, Result};
use crate::features::manifest::{Manifest, ShardEntry, ShardSplit, MANIFEST_FILE};
use crate::features::shard::{ShardData, ShardLayout};

/// A complete feature directory.
pub struct FeatureSet {
    pub dir: PathBuf,
    pub manifest: Manifest,
}

/// A shard that failed verification.
#[derive(Debug, Clone)]
pub struct ShardProblem {
    pub file: String,
    pub message: String,
}

impl FeatureSet {
    /// Opens `dir`; an error when it has no manifest or `prepare` did not finish there.
    pub fn open(dir: &Path) -> Result<Self> {
        let manifest = Manifest::read(dir)?.ok_or_else(|| {
            DatasetError::features(
                dir,
                format!("no {MANIFEST_FILE}: not a feature directory (make one with `headway-train prepare`)"),
            )
        })?;
        if !manifest.complete {
            return Err(DatasetError::features(
                dir,
                format!(
                    "prepare did not finish ({} of {} shards); rerun the same prepare command to \
                     resume",
                    manifest.shards.len(),
                    manifest.planned_shards
                ),
            ));
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            manifest,
        })
    }

    /// Checks that the features came from the target with `fingerprint` (loaded from `target_dir`).
    pub fn check_target(&self, fingerprint: &str, target_dir: &Path) -> Result<()> {
        let target = &self.manifest.settings.target;
        if target.fingerprint == fingerprint {
            return Ok(());
        }
        Err(DatasetError::TargetMismatch {
            dir: self.dir.clone(),
            expected_fingerprint: target.fingerprint.clone(),
            expected_dir: target.dir.clone(),
            found_fingerprint: fingerprint.to_string(),
            found_dir: target_dir.display().to_string(),
        })
    }

    /// Shards of one split, with their indices in the manifest.
    pub fn shards(&self, split: ShardSplit) -> impl Iterator<Item = (usize, &ShardEntry)> {
        self.manifest
            .shards
            .iter()
            .enumerate()
            .filter(move |(_, s)| s.split == split)
    }

    pub fn layout(&self) -> ShardLayout {
        let settings = &self.manifest.settings;
        ShardLayout {
            hidden_size: settings.target.hidden_size,
            taps: settings.extraction.taps.clone(),
            dtype: settings.extraction.dtype,
        }
    }

    /// Reads shard `index`, checking size and checksum first and then its contents against the
    /// manifest; errors name the shard file.
    pub fn load_shard(&self, index: usize) -> Result<ShardData> {
        let entry = &self.manifest.shards[index];
        let path = self.dir.join(&entry.file);
        let bytes = std::fs::read(&path).map_err(|e| {
            DatasetError::shard(
                &path,
                format!("listed in {MANIFEST_FILE} but unreadable: {e}"),
            )
        })?;
        if bytes.len() as u64 != entry.bytes {
            return Err(DatasetError::shard(
                &path,
                format!(
                    "{} bytes, the manifest says {} (truncated or replaced?)",
                    bytes.len(),
                    entry.bytes
                ),
            ));
        }
        let sha256 = bytes_sha256(&bytes);
        if sha256 != entry.sha256 {
            return Err(DatasetError::shard(
                &path,
                format!(
                    "checksum mismatch: the file is {sha256}, the manifest says {} (the shard is \
                     corrupt; rerun prepare into a new directory or restore it)",
                    entry.sha256
                ),
            ));
        }
        let shard = ShardData::from_bytes(&bytes, &path, &self.layout())?;
        let tokens = shard.tokens();
        if shard.len() != entry.sequences || tokens != entry.tokens {
            return Err(DatasetError::shard(
                &path,
                format!(
                    "holds {} sequences / {tokens} tokens, the manifest says {} / {}",
                    shard.len(),
                    entry.sequences,
                    entry.tokens
                ),
            ));
        }
        Ok(shard)
    }

    /// Verifies every shard (as [`FeatureSet::load_shard`] would) and reports each bad one.
    pub fn verify(&self) -> Vec<ShardProblem> {
        (0..self.manifest.shards.len())
            .filter_map(|i| {
                self.load_shard(i).err().map(|e| ShardProblem {
                    file: self.manifest.shards[i].file.clone(),
                    message: e.to_string(),
                })
            })
            .collect()
    }
}

/// Checks the cheap invariants of a shard file without loading it: present with the listed size
/// and checksum.
pub fn shard_file_matches(dir: &Path, entry: &ShardEntry) -> Result<bool> {
    let path = dir.join(&entry.file);
    Ok(
        std::fs::metadata(&path).is_ok_and(|m| m.len() == entry.bytes)
            && file_sha256(&path)? == entry.sha256,
    )
}
