//! Joining the N slices of a sharded `prepare` (`--shard I/N`) into one feature directory: the
//! single run's shards under their own names, in the single run's order, with a manifest that
//! equals the single run's but for the command line.
//!
//! Refused, naming the directories: a slice missing or given twice, slices of other counts,
//! unfinished slices, other settings (target fingerprint, corpus, extraction options, device
//! type) or counts, a shard listed twice, and a shard file whose size or checksum no longer
//! matches its slice's manifest. Shards are hard-linked where the file system allows it, copied
//! (atomically) where not; the manifest is written last, so an interrupted merge leaves no
//! manifest and rerunning it finishes the job. A finished merge rerun is a no-op.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use headway_model::files::{remove_stale_temp_files, write_atomically};

use crate::error::{DatasetError, Result};
use crate::features::feature_set::shard_file_matches;
use crate::features::manifest::{Manifest, ShardEntry, MANIFEST_FILE};

/// What a merge did.
#[derive(Debug, Clone)]
pub struct MergeSummary {
    pub manifest: Manifest,
    /// Shards hard-linked, copied, and found already in place (a rerun).
    pub linked: usize,
    pub copied: usize,
    pub kept: usize,
}

/// Merges the slice directories `slices` (any order) into `out`; `command` is recorded.
pub fn merge(slices: &[PathBuf], out: &Path, command: Vec<String>) -> Result<MergeSummary> {
    let manifests = read_slices(slices)?;
    let (first_dir, first) = &manifests[0];
    for (dir, manifest) in &manifests[1..] {
        check_same_run(first_dir, first, dir, manifest)?;
    }
    let ordered = plan_order(&manifests)?;
    let merged = Manifest {
        complete: true,
        planned_shards: ordered.len(),
        shards: ordered.iter().map(|&(_, entry)| entry.clone()).collect(),
        command,
        slice: None,
        ..first.clone()
    };
    std::fs::create_dir_all(out).map_err(|e| DatasetError::io(out, e))?;
    if let Some(existing) = Manifest::read(out)? {
        let same = Manifest {
            command: merged.command.clone(),
            ..existing
        } == merged;
        if !same {
            return Err(DatasetError::features(
                out,
                "already holds other features (a manifest that is not this merge's); use \
                 another --out",
            ));
        }
    }
    remove_stale_temp_files(out)?;
    let mut summary = MergeSummary {
        manifest: merged,
        linked: 0,
        copied: 0,
        kept: 0,
    };
    for (dir, entry) in &ordered {
        match place_shard(dir, entry, out)? {
            Placed::Linked => summary.linked += 1,
            Placed::Copied => summary.copied += 1,
            Placed::Kept => summary.kept += 1,
        }
    }
    summary.manifest.write(out)?;
    Ok(summary)
}

/// Each directory's manifest, which must be a finished slice; sorted by slice index, checked to
/// be slices 0 … N−1 of one N, each once.
fn read_slices(slices: &[PathBuf]) -> Result<Vec<(PathBuf, Manifest)>> {
    if slices.is_empty() {
        return Err(DatasetError::Argument(
            "merge-features: give the directories of the slices to join".into(),
        ));
    }
    let mut manifests = Vec::new();
    for dir in slices {
        let manifest = Manifest::read(dir)?.ok_or_else(|| {
            DatasetError::features(dir, format!("no {MANIFEST_FILE}: not a feature directory"))
        })?;
        let Some(slice) = manifest.slice else {
            return Err(DatasetError::features(
                dir,
                "holds a whole prepare run, not a slice of one (`prepare --shard I/N`)",
            ));
        };
        if !manifest.complete {
            return Err(DatasetError::features(
                dir,
                format!(
                    "slice {slice} did not finish ({} of {} shards); rerun its prepare command to \
                     resume",
                    manifest.shards.len(),
                    manifest.planned_shards
                ),
            ));
        }
        manifests.push((dir.clone(), manifest));
    }
    manifests.sort_by_key(|(_, m)| m.slice.map(|s| s.index));
    let count = manifests[0].1.slice.expect("checked above").count;
    for (position, (dir, manifest)) in manifests.iter().enumerate() {
        let slice = manifest.slice.expect("checked above");
        if slice.count != count {
            return Err(DatasetError::features(
                dir,
                format!(
                    "is slice {slice}, but {} is a slice of {count}: slices of different runs",
                    manifests[0].0.display()
                ),
            ));
        }
        if slice.index < position {
            return Err(DatasetError::features(
                dir,
                format!(
                    "is slice {slice}, as is {}: a slice given twice",
                    manifests[position - 1].0.display()
                ),
            ));
        }
        if slice.index > position {
            return Err(DatasetError::Argument(format!(
                "merge-features: slice {position}/{count} is missing (given: {})",
                names(&manifests)
            )));
        }
    }
    if manifests.len() < count {
        return Err(DatasetError::Argument(format!(
            "merge-features: slices {}..{count} of {count} are missing (given: {})",
            manifests.len(),
            names(&manifests)
        )));
    }
    Ok(manifests)
}

fn names(manifests: &[(PathBuf, Manifest)]) -> String {
    manifests
        .iter()
        .map(|(dir, m)| format!("{} = {}", dir.display(), m.slice.expect("a slice")))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Refuses a slice of another run: other settings, counts or format.
fn check_same_run(
    first_dir: &Path,
    first: &Manifest,
    dir: &Path,
    manifest: &Manifest,
) -> Result<()> {
    let labels = (
        format!("in {}", first_dir.display()),
        format!("in {}", dir.display()),
    );
    let mut differences = first
        .settings
        .differences(&manifest.settings, (&labels.0, &labels.1));
    if first.counts != manifest.counts {
        differences.push("counts (sequences, tokens, splits) differ".into());
    }
    if first.format != manifest.format {
        differences.push(format!("format {} and {}", first.format, manifest.format));
    }
    if differences.is_empty() {
        return Ok(());
    }
    Err(DatasetError::features(
        dir,
        format!(
            "was made by another run than {} ({}): merge only the slices of one command",
            first_dir.display(),
            differences.join("; ")
        ),
    ))
}

/// The shards in the single run's plan order: slice I holds plan positions I, I+N, I+2N, …
fn plan_order(manifests: &[(PathBuf, Manifest)]) -> Result<Vec<(&Path, &ShardEntry)>> {
    let count = manifests.len();
    let total: usize = manifests.iter().map(|(_, m)| m.shards.len()).sum();
    let mut ordered: Vec<(&Path, &ShardEntry)> = Vec::with_capacity(total);
    let mut listed_by: HashMap<&str, &Path> = HashMap::with_capacity(total);
    for position in 0..total {
        let (dir, manifest) = &manifests[position % count];
        let Some(entry) = manifest.shards.get(position / count) else {
            return Err(DatasetError::features(
                dir,
                format!(
                    "lists {} shards, too few for its place among {total}: slices of different \
                     runs",
                    manifest.shards.len()
                ),
            ));
        };
        if let Some(other) = listed_by.insert(&entry.file, dir) {
            return Err(DatasetError::features(
                dir,
                format!(
                    "lists {}, as does {}: overlapping slices",
                    entry.file,
                    other.display()
                ),
            ));
        }
        ordered.push((dir.as_path(), entry));
    }
    Ok(ordered)
}

enum Placed {
    Linked,
    Copied,
    Kept,
}

/// Puts the shard `entry` of slice directory `dir` into `out`, checking it first.
fn place_shard(dir: &Path, entry: &ShardEntry, out: &Path) -> Result<Placed> {
    let source = dir.join(&entry.file);
    if !shard_file_matches(dir, entry)? {
        return Err(DatasetError::shard(
            &source,
            format!(
                "missing, or its size or checksum differs from {}'s {MANIFEST_FILE} (rerun that \
                 slice's prepare)",
                dir.display()
            ),
        ));
    }
    let target = out.join(&entry.file);
    if target.exists() {
        if shard_file_matches(out, entry)? {
            return Ok(Placed::Kept);
        }
        std::fs::remove_file(&target).map_err(|e| DatasetError::io(&target, e))?;
    }
    // A hard link appears whole or not at all; across file systems, copy through a temporary
    // file instead.
    if std::fs::hard_link(&source, &target).is_ok() {
        return Ok(Placed::Linked);
    }
    write_atomically(&target, |file, temp| {
        let mut reader =
            std::fs::File::open(&source).map_err(|e| headway_model::ModelError::io(&source, e))?;
        std::io::copy(&mut reader, file).map_err(|e| headway_model::ModelError::io(temp, e))?;
        Ok(())
    })?;
    Ok(Placed::Copied)
}
