//! The custom resources served by opkit, one module per API group. Types only: behaviour
//! lives in `opkit-controllers`.

pub mod at;
pub mod eru;
pub mod foo;
pub mod memcached;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;

/// Every CRD opkit serves, in a stable order (for `opkit crd` and `make manifests`).
pub fn all_crds() -> Vec<CustomResourceDefinition> {
    use kube::CustomResourceExt;
    vec![memcached::crd(), at::At::crd(), eru::Eru::crd(), foo::Foo::crd()]
}

/// Labels every object opkit creates carries (`app.kubernetes.io/managed-by`).
pub const MANAGED_BY: &str = "opkit";
