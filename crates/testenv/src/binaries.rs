//! Locates (and builds on first use) the pinned control-plane binaries.
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{Error, Result};

const VERSIONS_ENV: &str = include_str!("../versions.env");

/// The pinned upstream versions, read from `versions.env` (the single place they live).
#[derive(Debug, Clone)]
pub struct Versions {
    /// Kubernetes (apiserver, controller-manager, scheduler, kubectl).
    pub kubernetes: String,
    /// etcd.
    pub etcd: String,
    /// kwok (the fake nodes).
    pub kwok: String,
}

impl Versions {
    /// The versions this crate was built with.
    pub fn pinned() -> Self {
        let get = |key: &str| {
            VERSIONS_ENV
                .lines()
                .filter_map(|l| l.split_once('='))
                .find(|(k, _)| k.trim() == key)
                .map(|(_, v)| v.trim().to_string())
                .unwrap_or_default()
        };
        Versions {
            kubernetes: get("KUBERNETES_VERSION"),
            etcd: get("ETCD_VERSION"),
            kwok: get("KWOK_VERSION"),
        }
    }
}

/// Where the binaries are; building them is left to `scripts/build-binaries.sh` so the Makefile
/// and the Rust API share one recipe and one cache.
#[derive(Debug, Clone)]
pub struct Binaries {
    dir: PathBuf,
}

impl Binaries {
    /// Returns the cached binaries, building any that are missing (a cold build takes long).
    /// `OPKIT_TESTENV_BIN_DIR` points at an existing directory instead.
    pub fn ensure() -> Result<Self> {
        if let Ok(dir) = std::env::var("OPKIT_TESTENV_BIN_DIR") {
            return Self::at(PathBuf::from(dir));
        }
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/build-binaries.sh");
        let out = Command::new("bash")
            .arg(&script)
            .stderr(std::process::Stdio::inherit())
            .output()
            .map_err(|e| Error::Build(format!("running {}: {e}", script.display())))?;
        if !out.status.success() {
            return Err(Error::Build(format!(
                "{} exited with {}",
                script.display(),
                out.status
            )));
        }
        let dir = String::from_utf8_lossy(&out.stdout)
            .lines()
            .last()
            .unwrap_or_default()
            .trim()
            .to_string();
        Self::at(PathBuf::from(dir))
    }

    fn at(dir: PathBuf) -> Result<Self> {
        let b = Binaries { dir };
        for name in [
            "etcd",
            "kube-apiserver",
            "kube-controller-manager",
            "kube-scheduler",
            "kubectl",
            "kwok",
        ] {
            if !b.path(name).is_file() {
                return Err(Error::Build(format!(
                    "{} is missing from {}",
                    name,
                    b.dir.display()
                )));
            }
        }
        Ok(b)
    }

    /// The directory holding every binary.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Path of one binary by name (`kubectl`, `etcd`, ...).
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pinned_versions_are_read_from_versions_env() {
        let v = Versions::pinned();
        assert!(v.kubernetes.starts_with("v1.35."), "{v:?}");
        assert!(v.etcd.starts_with("v3.6."), "{v:?}");
        assert!(v.kwok.starts_with("v0.8."), "{v:?}");
    }
}
