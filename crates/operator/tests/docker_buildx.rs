//! `make docker-buildx`: one image for linux/amd64 and linux/arm64 in the local control
//! plane's registry (an image index), each platform's binary compiled for it; the arm64 one runs
//! (under qemu-user) on nothing but its image's files. Needs `OPKIT_TESTENV_REAL_NODE=1` (the
//! registry runs with the real node), as `make test` sets.
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, ensure};

mod common;
use common::{discard_build, index_platforms, registry_manifest};

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

/// Unpacks every layer of `digest`'s image, in order, into `root`.
fn unpack(registry: &str, repository: &str, digest: &str, root: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(root)?;
    let m = registry_manifest(registry, repository, digest)?;
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
    // Debug binaries: the release profile's fat LTO would double the build for what the test
    // checks (the index, each binary's machine, the arm64 one running).
    let built = run(Command::new("make").arg("-C").arg(repo()).args([
        "docker-buildx",
        &format!("IMG={img}"),
        "PLATFORMS=linux/amd64,linux/arm64",
        "PROFILE=dev",
    ]))?;
    println!("{}", String::from_utf8_lossy(&built));

    let platforms = index_platforms(&registry_manifest(registry, "opkit", "multiarch")?)?;
    let digest_of = |arch: &str| {
        platforms
            .iter()
            .find(|(p, _)| *p == format!("linux/{arch}"))
            .map(|(_, d)| d.clone())
            .with_context(|| format!("no linux/{arch} in {platforms:?}"))
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
    if result.is_ok() {
        // The arm64 dependency tree serves `make docker-buildx` alone.
        let target = Path::new(env!("CARGO_TARGET_TMPDIR"))
            .parent()
            .context("the target directory")?;
        discard_build(&target.join("aarch64-unknown-linux-gnu"));
    }
    result
}
