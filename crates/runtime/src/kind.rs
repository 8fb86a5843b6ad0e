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
