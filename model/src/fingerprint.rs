//! A target's identity: a hash of what decides its hidden states, so features, heads and
//! checkpoints can be checked against the model they are used with.
//!
//! The fingerprint is SHA-256 over `config.json` and every weight file, each preceded by its name
//! and length (so moving bytes between files changes it). The directory's path is not part of
//! it: a copied or moved target keeps its fingerprint. A GGUF target's fingerprint is the same
//! hash over its one file (config, tokenizer and weights all live in it). The tokenizer and chat template are
//! recorded separately by the consumers that depend on them.

use std::io::Read;
use std::path::Path;

use sha2::{Digest, Sha256};

use crate::weights::weight_files;
use crate::{ModelError, Result};

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
}
