//! Carries plans out, in three parts that each read alone:
//! - [`cache`]: what a controller reads — [`Cache`], the [`Watch`] options that fill it
//!   (label selectors, trims, projections, indexes) and the kinds that can be watched;
//! - [`watches`]: how the declared watches become reflectors feeding the caches and
//!   triggering reconciles, and how opkit knows they have all synced;
//! - `driver`: one reconcile, from the sync gate through observe and plan to the outcome;
//! - `write`: every write a plan asks for (apply, create, prune, status, delete), each through
//!   the write gate;
//! - `admission`: the fair line requests wait in before the work queue;
//! - `resync`: the listed objects that wait behind new work;
//! - `queue`: the work queue and the loop that runs the reconciles (opkit's own, as the
//!   primary cache may be compact; a waiting request is one small entry per object);
//! - `hold`: statuses of work still under way, held back until it settles or takes long;
//! - `status`: opkit's status writes whose watch events the primary cache has not shown yet.
//!
//! `Store::wait_until_ready` wakes just one of several concurrent waiters, and a compact cache
//! has no store. So opkit never waits on a store: it watches every stream it builds for the
//! watcher's `InitDone` and keeps its own count; the work queue hands nothing out before
//! then.
mod admission;
pub(crate) mod context;
mod driver;
mod hold;
mod queue;
mod resync;
mod shared;
mod status;
pub mod watches;
mod write;

pub(crate) use driver::run;
pub(crate) use shared::{SharedWatches, Synced};
pub use watches::Watches;

/// Errors of the steps opkit carries out; the category labels metrics and log lines.
#[derive(Debug, thiserror::Error)]
#[allow(missing_docs)] // every variant says what failed in its message
pub enum Error {
    #[error("observing: {source}")]
    Observe { source: kube::Error },
    #[error("writing {child}: {source}")]
    Write { child: String, source: kube::Error },
    #[error("{child} exists and is not controlled by this object")]
    Conflict { child: String },
    #[error("{child} not written: namespace {namespace} is being deleted")]
    NamespaceTerminating { child: String, namespace: String },
    #[error("deleting {child}: {source}")]
    Prune { child: String, source: kube::Error },
    #[error("writing status: {source}")]
    Status { source: kube::Error },
    #[error("encoding: {0}")]
    Encode(#[from] serde_json::Error),
    #[error("not the leader (its lease may have expired): write refused")]
    NotLeader,
    #[error("the object changed since it was read; planning again from the newer version")]
    Stale,
    #[error("writing the finalizer: {source}")]
    Finalizer { source: kube::Error },
    #[error("{message}")]
    Cleanup { message: String },
    #[error("the reconcile took longer than {after:?} and was cancelled")]
    Timeout { after: std::time::Duration },
    #[error("the reconcile panicked: {message}")]
    Panic { message: String },
    #[error("{missing} {kind} taken over from the object's previous owner not yet in the cache")]
    Adopt { kind: String, missing: usize },
    #[error("{act}: {retry}")]
    Act { act: String, retry: crate::plan::Retry },
    #[error("{act}: the controller declared no outside source of its kind (Watches::outside)")]
    Undeclared { act: String },
}

impl Error {
    /// A write the client's gate refused on a retry (after the runtime's own check passed)
    /// is reported as [`Error::NotLeader`], like one refused before the first attempt.
    pub(crate) fn or_not_leader(self) -> Self {
        let source = match &self {
            Error::Observe { source }
            | Error::Write { source, .. }
            | Error::Prune { source, .. }
            | Error::Status { source }
            | Error::Finalizer { source } => source,
            _ => return self,
        };
        if crate::client::refused_by_gate(source) {
            Error::NotLeader
        } else {
            self
        }
    }

    /// A short stable label for metrics.
    pub fn category(&self) -> &'static str {
        match self {
            Error::Observe { .. } => "observe",
            Error::Write { .. } => "apply",
            Error::Conflict { .. } => "conflict",
            Error::NamespaceTerminating { .. } => "namespace_terminating",
            Error::Prune { .. } => "delete",
            Error::Status { .. } => "status",
            Error::Encode(_) => "encode",
            Error::NotLeader => "not_leader",
            Error::Stale => "stale",
            Error::Finalizer { .. } => "finalizer",
            Error::Cleanup { .. } => "cleanup",
            Error::Timeout { .. } => "timeout",
            Error::Panic { .. } => "panic",
            Error::Adopt { .. } => "adopt",
            Error::Act { .. } => "act",
            Error::Undeclared { .. } => "undeclared",
        }
    }
}
