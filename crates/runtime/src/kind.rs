//! The kinds opkit can watch, cache, own and reconcile, and how it reaches their API.
use std::fmt::Debug;

use k8s_openapi::{ClusterResourceScope, NamespaceResourceScope};
use kube::{Api, Client, Resource};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// Namespaced or cluster-scoped: how opkit reaches objects of a kind.
pub trait KindScope {
    /// Whether objects of the kind live in namespaces.
    const NAMESPACED: bool;

    /// The API of kind `K` in `namespace` (`None`: every namespace; ignored for a
    /// cluster-scoped kind).
    fn api<K: Resource<Scope = Self, DynamicType = ()>>(client: Client, namespace: Option<&str>) -> Api<K>;
}

impl KindScope for NamespaceResourceScope {
    const NAMESPACED: bool = true;

    fn api<K: Resource<Scope = Self, DynamicType = ()>>(client: Client, namespace: Option<&str>) -> Api<K> {
        match namespace {
            Some(ns) => Api::namespaced(client, ns),
            None => Api::all(client),
        }
    }
}

impl KindScope for ClusterResourceScope {
    const NAMESPACED: bool = false;

    fn api<K: Resource<Scope = Self, DynamicType = ()>>(client: Client, _: Option<&str>) -> Api<K> {
        Api::all(client)
    }
}

/// A kind opkit can watch and cache — namespaced (Pods, Deployments, most custom kinds) or
/// cluster-scoped (Namespaces, Nodes, cluster-scoped custom kinds): what every watch, cache,
/// child and primary needs.
pub trait Watchable:
    Resource<DynamicType = (), Scope: KindScope>
    + Clone
    + Debug
    + DeserializeOwned
    + Serialize
    + Send
    + Sync
    + 'static
{
}

impl<T> Watchable for T where
    T: Resource<DynamicType = (), Scope: KindScope>
        + Clone
        + Debug
        + DeserializeOwned
        + Serialize
        + Send
        + Sync
        + 'static
{
}

/// The API of `C` in `namespace` (`None`: all; cluster-scoped kinds ignore it).
pub(crate) fn api<C: Watchable>(client: &Client, namespace: Option<&str>) -> Api<C> {
    <C::Scope as KindScope>::api(client.clone(), namespace)
}

/// Whether objects of `C` live in namespaces.
pub(crate) fn namespaced<C: Watchable>() -> bool {
    <C::Scope as KindScope>::NAMESPACED
}

/// Whether `C` is a kind of Kubernetes itself or of its SIGs (the core group, `apps`,
/// `*.k8s.io`, not `*.x-k8s.io`), whose objects are mostly other people's.
pub(crate) fn built_in<C: Watchable>() -> bool {
    let group = C::group(&());
    !group.contains('.') || group == "k8s.io" || group.ends_with(".k8s.io")
}

/// A kind named when the operator runs (a flag, a configuration file) rather than when it is
/// built, as `kubectl` and RBAC name it: `PLURAL.VERSION.GROUP` (`deployments.v1.apps`,
/// `widgets.v1alpha1.example.com`), or `PLURAL.VERSION` for the core group (`configmaps.v1`).
/// Discovery finds its kind and scope once the apiserver serves it ([`crate::Watches::dynamic`]).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DynamicKind {
    /// The API group; empty for the core group.
    pub group: String,
    /// The version, e.g. `v1`.
    pub version: String,
    /// The plural resource name, e.g. `deployments`.
    pub plural: String,
}

impl std::str::FromStr for DynamicKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let mut parts = s.trim().splitn(3, '.');
        let (plural, version, group) = (parts.next(), parts.next(), parts.next().unwrap_or(""));
        let lower = |p: &str| {
            !p.is_empty()
                && p.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        };
        match (plural, version) {
            (Some(p), Some(v))
                if lower(p)
                    && lower(v)
                    && v.starts_with('v')
                    && (group.is_empty() || group.split('.').all(lower)) =>
            {
                Ok(DynamicKind {
                    group: group.into(),
                    version: v.into(),
                    plural: p.into(),
                })
            }
            _ => Err(format!(
                "{s:?} does not name a resource as PLURAL.VERSION.GROUP (deployments.v1.apps) or PLURAL.VERSION for the core group (configmaps.v1)"
            )),
        }
    }
}

impl std::fmt::Display for DynamicKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.group.is_empty() {
            write!(f, "{}.{}", self.plural, self.version)
        } else {
            write!(f, "{}.{}.{}", self.plural, self.version, self.group)
        }
    }
}

impl DynamicKind {
    /// The `apiVersion` of its objects: `v1`, `apps/v1`.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.clone()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }
}

/// A [`DynamicKind`] as discovery found it: what children and deletions of its objects need
/// ([`crate::Child::apply_dynamic`], [`crate::Deletion::of_dynamic`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResolvedKind {
    pub(crate) resource: kube::core::ApiResource,
    pub(crate) namespaced: bool,
}

impl ResolvedKind {
    /// A kind as the apiserver serves it (discovery does this for a watched one; a unit test
    /// of a plan makes its own).
    pub fn new(resource: kube::core::ApiResource, namespaced: bool) -> Self {
        ResolvedKind { resource, namespaced }
    }

    /// Its group, version, kind and plural.
    pub fn resource(&self) -> &kube::core::ApiResource {
        &self.resource
    }

    /// Whether its objects live in namespaces.
    pub fn namespaced(&self) -> bool {
        self.namespaced
    }
}

#[cfg(test)]
mod tests {
    use super::DynamicKind;

    #[test]
    fn dynamic_kinds_parse_as_kubectl_names_resources() {
        let k: DynamicKind = "deployments.v1.apps".parse().expect("parses");
        assert_eq!(
            (k.plural.as_str(), k.version.as_str(), k.group.as_str()),
            ("deployments", "v1", "apps")
        );
        assert_eq!(k.api_version(), "apps/v1");
        let k: DynamicKind = "widgets.v1alpha1.example.opkit.dev".parse().expect("parses");
        assert_eq!(k.group, "example.opkit.dev");
        assert_eq!(k.to_string(), "widgets.v1alpha1.example.opkit.dev");
        let core: DynamicKind = "configmaps.v1".parse().expect("parses");
        assert_eq!((core.group.as_str(), core.api_version()), ("", "v1".to_string()));
        assert_eq!(core.to_string(), "configmaps.v1");
        for bad in [
            "",
            "configmaps",
            "Deployment.v1.apps",
            "deployments.apps",
            "deployments..apps",
            "deployments.v1.Apps",
        ] {
            let err = bad.parse::<DynamicKind>().expect_err(bad);
            assert!(err.contains("PLURAL.VERSION.GROUP"), "{err}");
        }
    }
}
