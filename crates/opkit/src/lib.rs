//! opkit: the thin layer kube-rs leaves to each operator author — a controller skeleton
//! ([`Reconciler`]: declare watches, return a pure [`Plan`]), a runtime that carries plans out
//! (server-side apply that skips no-op writes, orphan pruning, status through the subresource,
//! Events, per-object backoff, synced caches), a manager with metrics, health probes and
//! leader election, admission webhooks, and one [`Operator`] (name, version, [`Registry`]) from
//! which the command line (`cli::main`), RBAC, the `config/` manifests and the OLM bundle are
//! generated.
//!
//! Watching is kube-runtime's watcher; the caches, the work queue and the reconcile loop are
//! opkit's, built for the memory and the guarantees an operator in production needs.
//!
//! # Features
//! - `cli` (default): the operator's command line ([`cli`]: `run`, `crd`, `manifests`, `helm`,
//!   `bundle`, `migrate-storage`) and its log subscriber. Implies `gen`.
//! - `gen`: generation of CRDs, RBAC, `config/`, the Helm chart, the OLM bundle and monitoring
//!   files (the `opkit-gen` crate).
//! - `otel` (default): traces over OTLP/HTTP when `OTEL_EXPORTER_OTLP_ENDPOINT` is set, and the
//!   trace id in the reconcile's log lines.
//!
//! An operator built with `default-features = false` compiles the runtime alone: no clap, no
//! YAML, no OpenTelemetry. opkit picks no Kubernetes version: enable one of k8s-openapi's
//! `v1_*` features in the binary.

#![deny(missing_docs)]

pub use opkit_runtime::*;

#[cfg(feature = "gen")]
pub use opkit_gen::{bundle, helm, manifests, monitoring, yaml};

#[cfg(feature = "cli")]
pub mod cli;
#[cfg(feature = "cli")]
pub mod telemetry;
