//! Files written so that a crash never leaves a half-written output under its final name.

use std::fs::File;
use std::path::Path;

use crate::{ModelError, Result};

/// Writes `path` through a temporary file in the same directory that is synced and then renamed
/// over `path`. `write` gets the open temporary file and its path (for writers that open by
/// path). Returns the size of the written file. On error the temporary file is removed.
pub fn write_atomically(
    path: &Path,
    write: impl FnOnce(&mut File, &Path) -> Result<()>,
) -> Result<u64> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
    let prefix = format!(".{}.", name.unwrap_or_default());
    let mut builder = tempfile::Builder::new();
    builder.prefix(&prefix).suffix(".tmp");
    // Temporary files are owner-only by default; the outputs get File::create's mode instead
    // (0666 less the umask).
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        builder.permissions(std::fs::Permissions::from_mode(0o666));
    }
    let mut temp = builder
        .tempfile_in(dir)
        .map_err(|e| ModelError::io(dir, e))?;
    let temp_path = temp.path().to_path_buf();
    write(temp.as_file_mut(), &temp_path)?;
    let file = temp.as_file();
    file.sync_all().map_err(|e| ModelError::io(&temp_path, e))?;
    let len = file
        .metadata()
        .map_err(|e| ModelError::io(&temp_path, e))?
        .len();
    temp.persist(path)
        .map_err(|e| ModelError::io(path, e.error))?;
    Ok(len)
}

/// [`write_atomically`] for bytes already in memory.
pub fn write_bytes_atomically(path: &Path, bytes: &[u8]) -> Result<u64> {
    write_atomically(path, |file, temp| {
        use std::io::Write;
        file.write_all(bytes).map_err(|e| ModelError::io(temp, e))
    })
}

/// Removes the temporary files that [`write_atomically`] leaves in `dir` when the process is killed
/// mid-write (`.<name>.<random>.tmp`); returns how many were removed.
pub fn remove_stale_temp_files(dir: &Path) -> Result<usize> {
    let mut removed = 0;
    for entry in std::fs::read_dir(dir).map_err(|e| ModelError::io(dir, e))? {
        let path = entry.map_err(|e| ModelError::io(dir, e))?.path();
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
        if name.is_some_and(|n| n.starts_with('.') && n.ends_with(".tmp")) && path.is_file() {
            std::fs::remove_file(&path).map_err(|e| ModelError::io(&path, e))?;
            removed += 1;
        }
    }
    Ok(removed)
}
