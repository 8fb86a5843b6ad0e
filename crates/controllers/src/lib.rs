//! The opkit controllers, one module per kind. Each module holds the whole story of its kind:
//! validation, the objects it builds, how it watches, and the RBAC rules it needs.

pub mod at;
pub mod eru;
pub mod foo;
pub mod memcached;
pub mod rbac;
mod scope;
pub mod webhooks;

pub use scope::Scope;
