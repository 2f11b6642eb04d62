//! The image archives a node imports: files given by name, or every archive in a directory.

use std::path::{Path, PathBuf};

use super::NodeError;

/// The archives named by `paths`: a file as it is, a directory as its `*.tar` files (sorted).
pub fn archives(paths: &[PathBuf]) -> Result<Vec<PathBuf>, NodeError> {
    let mut out = Vec::new();
    for path in paths {
        if path.is_dir() {
            let mut found: Vec<PathBuf> = std::fs::read_dir(path)?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "tar"))
                .collect();
            found.sort();
            out.extend(found);
        } else if path.is_file() {
            out.push(path.clone());
        } else {
            return Err(NodeError::Setup(format!("no image archive at {}", Path::new(path).display())));
        }
    }
    Ok(out)
}

/// The image archives of `scripts/images`: `$NFTPROXY_IMAGES` when set, else what the script
/// builds or has cached (it prints the directory as its last line).
pub fn locate() -> Result<Vec<PathBuf>, NodeError> {
    let dir = match std::env::var_os("NFTPROXY_IMAGES") {
        Some(dir) => PathBuf::from(dir),
        None => {
            let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/images");
            let out = std::process::Command::new(&script)
                .stderr(std::process::Stdio::inherit())
                .output()
                .map_err(|e| NodeError::Setup(format!("{}: {e}", script.display())))?;
            if !out.status.success() {
                return Err(NodeError::Setup(format!("{} exited with {}", script.display(), out.status)));
            }
            let stdout = String::from_utf8_lossy(&out.stdout);
            PathBuf::from(stdout.lines().last().unwrap_or("").trim())
        }
    };
    archives(&[dir])
}
