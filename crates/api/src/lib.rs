//! The custom resources served by opkit, one module per API group. Types only: behaviour
//! lives in `opkit-controllers`.

pub mod at;
pub mod config_mirror;
pub mod crontab;
pub mod eru;
pub mod foo;
pub mod memcached;
pub mod postgres;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceDefinition, ValidationRule,
};

/// The longest label value; Memcached and Foo names become label values of their children.
pub const MAX_LABEL_VALUE: usize = 63;

/// The message every name-length refusal carries, from the apiserver or the controller.
pub fn name_too_long(max: usize, why: &str) -> String {
    format!("metadata.name must be at most {max} characters: {why}")
}

/// Refuses, at admission, names the controller could not use: a CEL rule on `metadata.name`
/// in every version, so the error names the field and the limit instead of failing every
/// reconcile later.
pub(crate) fn limit_name(
    mut crd: CustomResourceDefinition,
    max: usize,
    why: &str,
) -> CustomResourceDefinition {
    for v in &mut crd.spec.versions {
        if let Some(root) = v.schema.as_mut().and_then(|s| s.open_api_v3_schema.as_mut()) {
            root.x_kubernetes_validations
                .get_or_insert_with(Vec::new)
                .push(ValidationRule {
                    rule: format!("size(self.metadata.name) <= {max}"),
                    message: Some(name_too_long(max, why)),
                    ..Default::default()
                });
        }
    }
    crd
}

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
