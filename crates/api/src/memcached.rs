//! `Memcached` (`cache.example.com`): `spec.size` memcached Pods behind one Deployment, as in
//! the Operator SDK tutorial. `v1alpha1` and `v1` are served with one schema; `v1` is stored.
//!
//! A missing `spec.size` (or `spec`) is a schema default, applied by the apiserver itself: no
//! webhook has to be reachable for a Memcached without a size to be admitted.
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResourceExt;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The largest `spec.size` accepted; more memcached Pods per object is almost certainly a typo.
pub const MAX_SIZE: i32 = 100;

/// `spec.size` of a Memcached created without one.
pub const DEFAULT_SIZE: i32 = 1;

fn default_size() -> i32 {
    DEFAULT_SIZE
}

/// Observed state, written only by the operator through the status subresource.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MemcachedStatus {
    /// Names of the memcached Pods (sorted), as in the Operator SDK tutorial.
    #[serde(default)]
    pub nodes: Vec<String>,
    /// How many of those Pods are Ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_replicas: Option<i32>,
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Available`, `Progressing` and `Degraded`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

macro_rules! memcached_version {
    ($module:ident, $version:literal) => {
        #[doc = concat!("`cache.example.com/", $version, "`.")]
        pub mod $module {
            use super::*;
            use kube::CustomResource;

            /// Desired state: how many memcached Pods to run.
            #[derive(CustomResource, Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
            #[kube(
                group = "cache.example.com",
                version = $version,
                kind = "Memcached",
                doc = "A memcached cluster: `spec.size` memcached Pods behind one Deployment; `status.nodes` lists them.",
                namespaced,
                status = "MemcachedStatus",
                shortname = "mc",
                category = "opkit",
                scale(spec_replicas_path = ".spec.size", status_replicas_path = ".status.readyReplicas"),
                printcolumn(name = "Size", type_ = "integer", json_path = ".spec.size"),
                printcolumn(name = "Ready", type_ = "integer", json_path = ".status.readyReplicas"),
                printcolumn(name = "Available", type_ = "string", json_path = ".status.conditions[?(@.type==\"Available\")].status"),
                printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
            )]
            #[serde(rename_all = "camelCase")]
            pub struct MemcachedSpec {
                /// Number of memcached Pods (0 to 100; 1 when left out).
                #[schemars(range(min = 0, max = 100))]
                #[serde(default = "default_size")]
                pub size: i32,
            }
        }
    };
}

memcached_version!(v1alpha1, "v1alpha1");
memcached_version!(v1, "v1");

pub use v1::{Memcached, MemcachedSpec};

/// Why a Memcached's name is limited: its Pods carry it as a label value.
pub const NAME_LIMIT_REASON: &str = "it labels the memcached Pods";

/// The CRD with both versions; `v1` is the storage version. `spec` defaults to `{}`, so a
/// Memcached without one gets the default size too.
pub fn crd() -> CustomResourceDefinition {
    let mut crd = kube::core::crd::merge_crds(vec![v1alpha1::Memcached::crd(), v1::Memcached::crd()], "v1")
        .expect("both Memcached versions share group, kind and scope");
    for version in &mut crd.spec.versions {
        let root = version
            .schema
            .as_mut()
            .and_then(|s| s.open_api_v3_schema.as_mut());
        if let Some(spec) = root
            .and_then(|r| r.properties.as_mut())
            .and_then(|p| p.get_mut("spec"))
        {
            spec.default = Some(
                k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::JSON(serde_json::json!(
                    {}
                )),
            );
        }
    }
    crate::limit_name(crd, crate::MAX_LABEL_VALUE, NAME_LIMIT_REASON)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_versions_are_served_with_one_schema_and_v1_is_stored() {
        let crd = crd();
        let versions = &crd.spec.versions;
        let mut flags: Vec<_> = versions
            .iter()
            .map(|v| (v.name.as_str(), v.served, v.storage))
            .collect();
        flags.sort();
        assert_eq!(flags, vec![("v1", true, true), ("v1alpha1", true, false)]);
        assert_eq!(versions[0].schema, versions[1].schema);
        let spec = serde_json::to_value(&versions[1].schema).unwrap();
        let size = &spec["openAPIV3Schema"]["properties"]["spec"]["properties"]["size"];
        assert_eq!(size["minimum"], 0.0);
        assert_eq!(size["maximum"], f64::from(MAX_SIZE));
        // Defaults the apiserver applies: no webhook needed for a Memcached without a size.
        assert_eq!(size["default"], DEFAULT_SIZE);
        assert_eq!(
            spec["openAPIV3Schema"]["properties"]["spec"]["default"],
            serde_json::json!({})
        );
        assert!(spec["openAPIV3Schema"]["properties"]["spec"]["required"].is_null());
        assert_eq!(crd.spec.names.short_names, Some(vec!["mc".to_string()]));
    }
}
