//! A real local Kubernetes control plane (etcd, kube-apiserver, kube-controller-manager,
//! kube-scheduler and kwok fake nodes, plus a real node on request: [`node`]) for controller
//! tests and the dev loop.
//!
//! Tests call [`shared`] for one cluster per test binary (or the long-lived one from
//! `make testenv-up` when `KUBECONFIG` points at it) and [`TestNamespace`] for isolation.

#![deny(missing_docs)]

mod binaries;
pub mod cli;
mod cluster;
mod harness;
pub mod node;
mod pki;
pub mod postgres;
mod process;
pub mod proxy;

pub use binaries::{Binaries, Versions};
pub use cluster::{ControlPlane, Options, config_from_file};
pub use harness::{
    Shared, TestNamespace, consistently, http_get, http_request, https_get, kubeconfig_with_token, shared,
    shared_real_node, tls_connector, tls_trusted, wait_for,
};
pub use nix::sys::signal::Signal;
pub use process::{Component, free_port};

/// Annotation that makes kwok finish a one-shot Pod with the given exit code (`Failed` unless
/// 0). Without it the exit code comes from the script: `false` is 1, `exit N` is N, else 0.
pub const EXIT_CODE_ANNOTATION: &str = "testenv.opkit.dev/exit-code";
/// Annotation that sets how long kwok lets a one-shot Pod run (a Go duration such as `5s`).
/// Without it the script `sleep N` runs N seconds, anything else about one second.
pub const RUN_FOR_ANNOTATION: &str = "testenv.opkit.dev/run-for";

/// Errors from building or running the control plane.
#[derive(Debug, thiserror::Error)]
#[allow(missing_docs)] // every variant says what failed in its message
pub enum Error {
    #[error("building the control-plane binaries failed: {0}")]
    Build(String),
    #[error("{component} failed to start: {reason}\n--- last lines of {log} ---\n{tail}")]
    Component {
        component: String,
        reason: String,
        log: String,
        tail: String,
    },
    #[error("{0}")]
    Setup(String),
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error("kubernetes api: {0}")]
    Kube(#[from] kube::Error),
}

/// Result with the testenv error.
pub type Result<T, E = Error> = std::result::Result<T, E>;
