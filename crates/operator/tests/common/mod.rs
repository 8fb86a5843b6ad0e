//! Shared by the tests that run the `opkit` binary: kubectl, CRD install, processes.
#![allow(dead_code)]
use std::process::{Child, Command, Stdio};

use anyhow::{Context, ensure};
use opkit_testenv::shared;

/// Runs the pinned kubectl against the local control plane; its stdout, or an error with
/// its stderr.
pub fn kubectl(args: &[&str]) -> anyhow::Result<String> {
    let out = shared().kubectl().args(args).output()?;
    ensure!(
        out.status.success(),
        "kubectl {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?)
}

/// Runs kubectl with `input` on stdin: (succeeded, stdout + stderr).
pub fn kubectl_stdin(args: &[&str], input: &[u8]) -> anyhow::Result<(bool, String)> {
    let mut c = shared()
        .kubectl()
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    std::io::Write::write_all(c.stdin.as_mut().context("stdin")?, input)?;
    let out = c.wait_with_output()?;
    Ok((
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    ))
}

/// `opkit crd | kubectl apply --server-side -f -`, as `make install` does.
pub fn install_crds() -> anyhow::Result<()> {
    let crds = Command::new(env!("CARGO_BIN_EXE_opkit")).arg("crd").output()?;
    ensure!(crds.status.success(), "opkit crd failed");
    let (ok, out) = kubectl_stdin(&["apply", "--server-side", "-f", "-"], &crds.stdout)?;
    ensure!(ok, "installing the CRDs failed: {out}");
    Ok(())
}

/// `opkit <args>` against the local control plane.
pub fn opkit(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_opkit"));
    c.args(args).env("KUBECONFIG", shared().kubeconfig());
    c
}

/// A child process killed on drop.
pub struct Running(pub Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Sends SIGTERM, as the kubelet does on a Pod's deletion.
pub fn sigterm(pid: u32) {
    let _ = Command::new("kill").args(["-TERM", &pid.to_string()]).status();
}

/// A loopback port nobody listens on right now.
pub fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}
