//! The container images a real node runs, built offline by `scripts/images` as OCI archives that
//! `ctr -n k8s.io images import` takes: nftproxy's (two builds with different digests, for a
//! rolling update), upstream's kube-proxy, pause, CoreDNS and agnhost, each under the name its
//! manifests use (kubeadm's, deploy/'s, the e2e framework's).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use thiserror::Error;

/// Errors finding or reading the images.
#[derive(Debug, Error)]
pub enum ImagesError {
    #[error("scripts/images: {0}")]
    Build(String),
    #[error("{path}: {message}")]
    Index { path: PathBuf, message: String },
    #[error("no image named {0} among the built ones")]
    Missing(String),
}

/// One image: a line of the directory's `index.tsv`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Image {
    /// The name as manifests write it (`nftproxy:0.1.0`, `registry.k8s.io/pause:3.10.2`).
    pub name: String,
    /// The reference containerd stores it under (`docker.io/library/nftproxy:0.1.0`): what the
    /// CRI looks a manifest's name up as.
    pub reference: String,
    /// The OCI archive.
    pub archive: PathBuf,
    /// The manifest's digest.
    pub digest: String,
    /// Bytes a registry would hold: manifest, config and the compressed layer.
    pub size: u64,
    /// Bytes of the layer's tar.
    pub unpacked: u64,
    /// The Debian packages in it, `name=version`.
    pub packages: Vec<String>,
}

/// The images of one `scripts/images` run.
#[derive(Debug, Clone)]
pub struct Images {
    dir: PathBuf,
    images: Vec<Image>,
}

/// The environment variable naming a directory `scripts/images` printed.
pub const IMAGES_ENV: &str = "NFTPROXY_IMAGES";

impl Images {
    /// `$NFTPROXY_IMAGES` when set, else what `scripts/images` builds or has cached (seconds
    /// once cached; it builds nftproxy's release binary and runs `scripts/upstream-bins`).
    pub fn locate() -> Result<Images, ImagesError> {
        if let Some(dir) = std::env::var_os(IMAGES_ENV) {
            return Images::open(Path::new(&dir));
        }
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/images");
        let out = Command::new(&script)
            .stderr(Stdio::inherit())
            .output()
            .map_err(|e| ImagesError::Build(format!("{}: {e}", script.display())))?;
        if !out.status.success() {
            return Err(ImagesError::Build(format!("exited with {}", out.status)));
        }
        let stdout = String::from_utf8_lossy(&out.stdout);
        match stdout.lines().last().map(str::trim) {
            Some(dir) if !dir.is_empty() => Images::open(Path::new(dir)),
            _ => Err(ImagesError::Build("printed no directory".into())),
        }
    }

    /// The images listed in `dir/index.tsv`.
    pub fn open(dir: &Path) -> Result<Images, ImagesError> {
        let path = dir.join("index.tsv");
        let text = std::fs::read_to_string(&path)
            .map_err(|e| ImagesError::Index { path: path.clone(), message: e.to_string() })?;
        let images = parse_index(dir, &text).map_err(|message| ImagesError::Index { path, message })?;
        Ok(Images { dir: dir.to_path_buf(), images })
    }

    /// The directory of archives.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Every image, in the index's order.
    pub fn all(&self) -> &[Image] {
        &self.images
    }

    /// The image a manifest names (`name`), or containerd's reference for it.
    pub fn get(&self, name: &str) -> Result<&Image, ImagesError> {
        self.images
            .iter()
            .find(|i| i.name == name || i.reference == name)
            .ok_or_else(|| ImagesError::Missing(name.to_string()))
    }
}

fn parse_index(dir: &Path, text: &str) -> Result<Vec<Image>, String> {
    let mut lines = text.lines();
    let header = lines.next().ok_or("empty")?;
    if header.split('\t').collect::<Vec<_>>() != ["name", "ref", "archive", "digest", "size", "unpacked", "packages"] {
        return Err(format!("unexpected header {header:?}"));
    }
    lines
        .map(|line| {
            let f: Vec<&str> = line.split('\t').collect();
            let [name, reference, archive, digest, size, unpacked, packages] = f[..] else {
                return Err(format!("a line of {} fields: {line:?}", f.len()));
            };
            let number = |s: &str| s.parse::<u64>().map_err(|e| format!("{s:?}: {e}"));
            Ok(Image {
                name: name.to_string(),
                reference: reference.to_string(),
                archive: dir.join(archive),
                digest: digest.to_string(),
                size: number(size)?,
                unpacked: number(unpacked)?,
                packages: packages.split(',').filter(|p| !p.is_empty() && *p != "-").map(String::from).collect(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_index_is_read_line_by_line() {
        let text = "name\tref\tarchive\tdigest\tsize\tunpacked\tpackages\n\
                    nftproxy:0.1.0\tdocker.io/library/nftproxy:0.1.0\tnftproxy_0.1.0.tar\tsha256:ab\t10\t20\tlibc6=2.36,libmnl0=1.0.4-3\n\
                    registry.k8s.io/pause:3.10.2\tregistry.k8s.io/pause:3.10.2\tpause.tar\tsha256:cd\t1\t2\t-\n";
        let images = parse_index(Path::new("/d"), text).unwrap();
        assert_eq!(images.len(), 2);
        assert_eq!(images[0].archive, Path::new("/d/nftproxy_0.1.0.tar"));
        assert_eq!(images[0].packages, ["libc6=2.36", "libmnl0=1.0.4-3"]);
        assert!(images[1].packages.is_empty());
        assert_eq!((images[1].size, images[1].unpacked), (1, 2));
        assert!(parse_index(Path::new("/d"), "name\tref\n").is_err());
        assert!(parse_index(Path::new("/d"), &text.replace("\t10\t", "\tten\t")).is_err());
    }
}
