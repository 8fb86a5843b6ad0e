//! The custom resources served by opkit, one module per API group. Types only: behaviour
//! lives in `opkit-controllers`.

pub mod at;
pub mod eru;
pub mod foo;
pub mod memcached;

/// Labels every object opkit creates carries (`app.kubernetes.io/managed-by`).
pub const MANAGED_BY: &str = "opkit";

/// Schema of a field that names a Deployment in the same namespace: a DNS subdomain, refused
/// by the apiserver with a readable message (shared by `Eru` and `Foo`).
pub(crate) fn deployment_name(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "string",
        "maxLength": 253,
        "x-kubernetes-validations": [{
            "rule": "self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$')",
            "message": "must be a Deployment name (lowercase letters, digits, '-' and '.')"
        }]
    })
}
