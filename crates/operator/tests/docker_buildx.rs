//! `make docker-buildx`: one image for linux/amd64 and linux/arm64 in the local control
//! plane's registry (an image index), each platform's binary compiled for it; the arm64 one runs
//! (under qemu-user) on nothing but its image's files. Needs `OPKIT_TESTENV_REAL_NODE=1` (the
//! registry runs with the real node), as `make test` sets.
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, ensure};
use serde_json::Value;

fn repo() -> PathBuf {
    PathBuf::from(format!("{}/../..", env!("CARGO_MANIFEST_DIR")))
}

fn run(cmd: &mut Command) -> anyhow::Result<Vec<u8>> {
    let out = cmd.output()?;
    ensure!(
        out.status.success(),
        "{cmd:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(out.stdout)
}

/// A registry document (manifest or index) as JSON.
fn manifest(registry: &str, repository: &str, reference: &str) -> anyhow::Result<Value> {
    let accept = [
        "application/vnd.oci.image.index.v1+json",
        "application/vnd.docker.distribution.manifest.list.v2+json",
        "application/vnd.oci.image.manifest.v1+json",
        "application/vnd.docker.distribution.manifest.v2+json",
    ]
    .join(",");
    let body = run(Command::new("curl")
        .args(["-sf", "-H", &format!("Accept: {accept}")])
        .arg(format!("http://{registry}/v2/{repository}/manifests/{reference}")))?;
    Ok(serde_json::from_slice(&body)?)
}

/// Unpacks every layer of `digest`'s image, in order, into `root`.
fn unpack(registry: &str, repository: &str, digest: &str, root: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(root)?;
    let m = manifest(registry, repository, digest)?;
    let layers = m["layers"].as_array().context("an image manifest has layers")?;
    for layer in layers {
        let blob = layer["digest"].as_str().context("a layer digest")?;
        let file = root.with_extension("layer");
        run(Command::new("curl")
            .args(["-sf", "-o"])
            .arg(&file)
            .arg(format!("http://{registry}/v2/{repository}/blobs/{blob}")))?;
        run(Command::new("tar").arg("xf").arg(&file).arg("-C").arg(root))?;
        std::fs::remove_file(&file)?;
    }
    Ok(())
}

/// The ELF machine of a binary: 62 x86-64, 183 AArch64.
fn elf_machine(path: &Path) -> anyhow::Result<u16> {
    let bytes = std::fs::read(path)?;
    ensure!(
        bytes.starts_with(b"\x7fELF") && bytes.len() > 20,
        "{} is no ELF file",
        path.display()
    );
    Ok(u16::from_le_bytes([bytes[18], bytes[19]]))
}

#[test]
fn docker_buildx_pushes_one_image_for_amd64_and_arm64() -> anyhow::Result<()> {
    let Some(cluster) = opkit_testenv::shared_real_node() else {
        return Ok(());
    };
    let registry = cluster.registry().context("the real node has a registry")?;
    let img = format!("{registry}/opkit:multiarch");
    let built = run(Command::new("make").arg("-C").arg(repo()).args([
        "docker-buildx",
        &format!("IMG={img}"),
        "PLATFORMS=linux/amd64,linux/arm64",
    ]))?;
    println!("{}", String::from_utf8_lossy(&built));

    let index = manifest(registry, "opkit", "multiarch")?;
    let manifests = index["manifests"]
        .as_array()
        .context(format!("not an index: {index}"))?;
    let digest_of = |arch: &str| {
        manifests
            .iter()
            .find(|m| m["platform"]["architecture"] == arch && m["platform"]["os"] == "linux")
            .and_then(|m| m["digest"].as_str())
            .map(String::from)
            .with_context(|| format!("no linux/{arch} in {index}"))
    };
    let scratch = std::env::temp_dir().join(format!("opkit-buildx-{}", std::process::id()));
    let result = (|| {
        for (arch, machine) in [("amd64", 62), ("arm64", 183)] {
            let root = scratch.join(arch);
            unpack(registry, "opkit", &digest_of(arch)?, &root)?;
            ensure!(
                elf_machine(&root.join("opkit"))? == machine,
                "the {arch} image's /opkit is built for ELF machine {}",
                elf_machine(&root.join("opkit"))?
            );
        }
        // The arm64 binary runs with only its image's files (loader, glibc, libgcc).
        if Command::new("qemu-aarch64-static")
            .arg("--version")
            .output()
            .is_err()
        {
            run(Command::new("apt-get")
                .args([
                    "install",
                    "-y",
                    "-qq",
                    "--no-install-recommends",
                    "qemu-user-static",
                ])
                .env("DEBIAN_FRONTEND", "noninteractive"))?;
        }
        let arm64 = scratch.join("arm64");
        let out = run(Command::new("qemu-aarch64-static")
            .arg("-L")
            .arg(&arm64)
            .arg(arm64.join("opkit"))
            .arg("--version"))?;
        ensure!(
            String::from_utf8_lossy(&out).starts_with("opkit "),
            "{}",
            String::from_utf8_lossy(&out)
        );
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&scratch);
    result
}
