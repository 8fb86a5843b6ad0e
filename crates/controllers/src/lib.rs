//! The opkit controllers, one module per kind. Each module holds the whole story of its kind:
//! validation, the objects it builds, how it watches, and the RBAC rules it needs.

pub mod at;
pub mod eru;
pub mod foo;
pub mod memcached;
pub mod rbac;
mod scope;
pub mod security;
pub mod webhooks;

pub use scope::Scope;

/// Reconciles running at once per controller. Reconciles wait on the apiserver, not the CPU, so
/// one (controller-runtime's default) leaves most of the time idle, while no limit (kube-runtime's
/// default) lets a burst of thousands of objects hit the apiserver at once. Measured with 1000
/// Foos (docs/benchmark.md): 4 took 2.8x the direct-client floor to create the Deployments, 16
/// took 1.3x, unlimited 0.8x with more memory and some retried writes.
pub const DEFAULT_CONCURRENCY: u16 = 16;
