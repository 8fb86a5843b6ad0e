//! The runtime of opkit: a controller skeleton ([`Reconciler`]: declare watches, return a pure
//! [`Plan`]), a runtime that carries plans out (server-side apply that skips no-op writes,
//! orphan pruning, status through the subresource, Events, per-object backoff, synced caches),
//! a manager with metrics, health probes and leader election, admission webhooks, sharding, and
//! one [`Operator`] (name, version, [`Registry`]) from which the `opkit-gen` crate generates
//! RBAC, the `config/` manifests, the Helm chart and the OLM bundle.
//!
//! Authors use it through the `opkit` crate, which adds the command line and generation as
//! features. Watching is kube-runtime's watcher; the caches, the work queue and the
//! reconcile loop are opkit's, built for the memory and the guarantees an operator in
//! production needs.

#![deny(missing_docs)]

pub mod backoff;
mod cache;
pub mod conditions;
pub mod conversion;
pub mod diff;
mod expiring;
mod https;
mod kind;
pub mod leader;
mod manager;
pub mod metrics;
pub mod migrate;
mod operator;
mod outside;
mod plan;
pub mod rbac;
mod reconciler;
mod registry;
mod runtime;
pub mod schedule;
mod scope;
pub mod security;
pub mod server;
pub mod sharding;
pub mod testing;
mod tls;
mod trace;
mod trigger;
mod tuning;
pub mod webhook;

pub mod changed;
pub mod client;
pub use cache::{Cache, DynamicCache, Watch};
pub use kind::{DynamicKind, KindScope, ResolvedKind, Watchable};
pub use manager::{Manager, ManagerError, ManagerOptions};
pub use operator::{
    Connect, CrdError, Operator, RunConfig, RunError, Running, Started, WebhookServing, install_crd,
    own_namespace,
};
pub use outside::{Outside, OutsideCache};
pub use plan::{
    Act, Child, Cleanup, Deletion, Event, Invalid, OWNER_LABEL, Plan, Requeue, Retry, finalizer_name,
};
pub use reconciler::Reconciler;
pub use registry::{Registration, Registry, RunTimeKinds};
pub use runtime::Watches;
pub use scope::Scope;
pub use trigger::Trigger;
pub use tuning::{DEFAULT_CONCURRENCY, Tuning};

pub use k8s_openapi;
/// Re-exported so controllers and opkit agree on one version.
pub use kube;
