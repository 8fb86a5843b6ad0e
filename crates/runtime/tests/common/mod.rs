//! What the runtime's integration tests share.
use opkit_runtime::{Manager, Registration};

/// A registry entry with no CRDs, RBAC or webhooks: a controller of built-in kinds that the
/// in-memory harness runs.
pub fn entry<S>(name: &'static str, add: fn(&mut Manager, &S)) -> Registration<S> {
    Registration {
        name,
        crds: Vec::new,
        rbac: Vec::new,
        webhooks: |w| w,
        add,
    }
}
