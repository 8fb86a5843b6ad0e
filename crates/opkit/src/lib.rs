//! opkit: the thin layer kube-rs leaves to each operator author — a manager that runs several
//! controllers with metrics and health probes, server-side apply that skips no-op writes,
//! status conditions, Events and per-object backoff.
//!
//! Watching, caching, queueing and the reconcile loop itself are kube-runtime's `Controller`;
//! opkit only wires them together the way an operator in production needs.

pub mod apply;
pub mod backoff;
pub mod clock;
pub mod conditions;
pub mod context;
pub mod leader;
pub mod manager;
pub mod metrics;
mod server;
pub mod webhook;

pub use clock::Clock;
pub use context::{ControllerContext, ReconcileError};
pub use manager::{Manager, ManagerOptions};

pub use k8s_openapi;
/// Re-exported so controllers and opkit agree on one version.
pub use kube;
