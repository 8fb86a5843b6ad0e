//! `ConfigMirror` (`mirror.opkit.dev/v1alpha1`, cluster-scoped): copies one ConfigMap into every
//! namespace whose labels match a selector, follows namespaces as they appear and are
//! relabelled, and removes every copy before the mirror itself goes.
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use kube::{CustomResource, CustomResourceExt};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Desired state: which ConfigMap to copy, and where.
// Printer columns repeat `type_ = "string"`, which clippy mistakes for duplicated attributes.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "mirror.opkit.dev",
    version = "v1alpha1",
    kind = "ConfigMirror",
    doc = "Copies one ConfigMap into every namespace whose labels match `spec.namespaceSelector`; deleting the mirror removes the copies.",
    status = "ConfigMirrorStatus",
    shortname = "cmirror",
    category = "opkit",
    printcolumn(name = "Source", type_ = "string", json_path = ".spec.source.name"),
    printcolumn(name = "Namespaces", type_ = "integer", json_path = ".status.syncedCount"),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
pub struct ConfigMirrorSpec {
    /// The ConfigMap to copy.
    pub source: SourceRef,
    /// Namespaces to copy it into: those whose labels match (an empty selector matches every
    /// namespace). The source's own namespace is never written to.
    pub namespace_selector: LabelSelector,
}

/// A ConfigMap by namespace and name.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
pub struct SourceRef {
    /// Namespace of the ConfigMap.
    #[schemars(length(min = 1, max = 63))]
    pub namespace: String,
    /// Name of the ConfigMap; the copies have the same name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
}

/// Observed state, written only by the operator through the status subresource.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ConfigMirrorStatus {
    /// The namespaces that hold an up-to-date copy (sorted).
    #[serde(default)]
    pub namespaces: Vec<String>,
    /// How many namespaces that is (for `kubectl get`).
    #[serde(default)]
    pub synced_count: i32,
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready`; `Deleting` while a cleanup fails.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// Why a ConfigMirror's name is limited: the copies carry it as a label value.
pub const NAME_LIMIT_REASON: &str = "it labels the copies";

/// The CRD.
pub fn crd() -> CustomResourceDefinition {
    crate::limit_name(ConfigMirror::crd(), crate::MAX_LABEL_VALUE, NAME_LIMIT_REASON)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_crd_is_cluster_scoped_with_a_status_subresource() {
        let crd = crd();
        assert_eq!(crd.spec.scope, "Cluster");
        assert_eq!(crd.spec.names.kind, "ConfigMirror");
        let v = &crd.spec.versions[0];
        assert!(v.subresources.as_ref().and_then(|s| s.status.as_ref()).is_some());
    }
}
