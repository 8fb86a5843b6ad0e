//! The runtime of opkit: a controller skeleton ([`Reconciler`]: declare watches, return a pure
//! [`Plan`]), a runtime that carries plans out (server-side apply that skips no-op writes,
//! orphan pruning, status through the subresource, Events, per-object backoff, synced caches),
//! a manager with metrics, health probes and leader election, admission webhooks, sharding, and
//! one [`Operator`] (name, version, [`Registry`]) from which the `opkit-gen` crate generates
//! RBAC, the `config/` manifests, the Helm chart and the OLM bundle.
//!
//! Authors use it through the `opkit` crate, which adds the command line and generation as
//! features. Watching, caching, queueing and the reconcile loop itself are kube-runtime's
//! `Controller`; opkit only wires them together the way an operator in production needs.

#![warn(missing_docs)]

pub mod backoff;
pub mod conditions;
mod context;
pub mod conversion;
pub mod diff;
mod https;
pub mod leader;
pub mod manager;
pub mod metrics;
pub mod migrate;
pub mod operator;
pub mod rbac;
pub mod reconciler;
pub mod registry;
pub mod runtime;
mod scope;
pub mod security;
pub mod server;
pub mod sharding;
mod tls;
mod trace;
pub mod webhook;

pub mod changed;
pub mod client;
pub use manager::{DEFAULT_CONCURRENCY, Manager, ManagerOptions, Tuning};
pub use operator::{Connect, Operator, RunConfig, RunError, Running, Started, WebhookServing};
pub use reconciler::{
    Child, Cleanup, Deletion, Event, Invalid, OWNER_LABEL, Plan, Reconciler, Requeue, finalizer,
};
pub use registry::{Registration, Registry};
pub use runtime::{Cache, KindScope, Watch, Watchable, Watches};
pub use scope::Scope;

pub use k8s_openapi;
/// Re-exported so controllers and opkit agree on one version.
pub use kube;
