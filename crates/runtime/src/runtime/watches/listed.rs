//! The objects of a watch whose cache keeps what the controller applied
//! ([`crate::Watch::applied`]): decoded as a JSON tree and projected from it.
//!
//! Decoded into `C` first, as kube's watcher does, each object had to be serialised back into
//! a tree to be projected and decoded again: at a restart with 10000 cached Deployments the
//! projection took a fifth of opkit's CPU until ready. From the tree, JSON to cache takes
//! about 50 µs a memcached Deployment instead of 70, and opkit's CPU until ready at that
//! restart fell by 13 % (docs/benchmark.md).
use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Resource;
use kube::runtime::watcher;
use prometheus_client::metrics::counter::Counter;
use serde::de::{Deserialize, DeserializeOwned, Deserializer};
use serde_json::Value;

use crate::cache::Cache;
use crate::diff::{applied_entries, applied_fields};

/// An object of `C` as its watch decoded it: its JSON tree, and of its metadata the resource
/// version (which the watcher follows) and what names it (for the cache and the logs).
pub(crate) struct Listed<C> {
    meta: ObjectMeta,
    tree: Value,
    kind: PhantomData<fn() -> C>,
}

impl<C> Listed<C> {
    fn name(&self) -> &str {
        self.meta.name.as_deref().unwrap_or_default()
    }

    /// What `manager` applied to the object ([`crate::diff::applied_by`]), as `C`; the whole
    /// object, without its managed fields, when the manager applied nothing to it or the
    /// projection does not make a `C`. An error only when the object is no `C` at all.
    pub(crate) fn into_object(mut self, manager: &str) -> serde_json::Result<C>
    where
        C: DeserializeOwned,
    {
        let entries = self
            .tree
            .get_mut("metadata")
            .and_then(Value::as_object_mut)
            .and_then(|m| m.remove("managedFields"))
            .unwrap_or_default();
        let applied = applied_entries(&entries, manager);
        let projected = applied_fields(&self.tree, applied).and_then(|p| serde_json::from_value(p).ok());
        match projected {
            Some(o) => Ok(o),
            None => serde_json::from_value(self.tree),
        }
    }
}

/// `ev` with its object as `manager` applied it ([`Listed::into_object`]). An object that does
/// not decode as `C` is logged, counted in `undecodable` and left out, and the watch goes on:
/// a deletion then removes the copy `cache` holds, and a change leaves it as it was (a typed
/// watch failed the event and went on past it too, or failed the whole list).
pub(crate) fn projected<C: Resource<DynamicType = ()> + Clone + DeserializeOwned>(
    ev: watcher::Event<Listed<C>>,
    manager: &str,
    cache: &Cache<C>,
    undecodable: &Counter,
) -> Option<watcher::Event<C>> {
    let object = |mut l: Listed<C>| {
        // The names move out of the object (its projection does not read them): nothing is
        // copied for the objects that decode.
        let meta = std::mem::take(&mut l.meta);
        l.into_object(manager).map_err(|e| {
            let (namespace, name) = (meta.namespace.unwrap_or_default(), meta.name.unwrap_or_default());
            tracing::error!(kind = %C::kind(&()), namespace, name, error = %e, "a watched object does not decode");
            undecodable.inc();
            (namespace, name)
        })
    };
    Some(match ev {
        watcher::Event::Init => watcher::Event::Init,
        watcher::Event::InitDone => watcher::Event::InitDone,
        watcher::Event::InitApply(l) => watcher::Event::InitApply(object(l).ok()?),
        watcher::Event::Apply(l) => watcher::Event::Apply(object(l).ok()?),
        watcher::Event::Delete(l) => watcher::Event::Delete(match object(l) {
            Ok(o) => o,
            Err((namespace, name)) => (*cache.get(&namespace, &name)?).clone(),
        }),
    })
}

impl<'de, C> Deserialize<'de> for Listed<C> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let tree = Value::deserialize(d)?;
        let text = |k: &str| tree["metadata"][k].as_str().map(String::from);
        let meta = ObjectMeta {
            name: text("name"),
            namespace: text("namespace"),
            uid: text("uid"),
            resource_version: text("resourceVersion"),
            ..ObjectMeta::default()
        };
        Ok(Listed {
            meta,
            tree,
            kind: PhantomData,
        })
    }
}

impl<C> Clone for Listed<C> {
    fn clone(&self) -> Self {
        Listed {
            meta: self.meta.clone(),
            tree: self.tree.clone(),
            kind: PhantomData,
        }
    }
}

impl<C> fmt::Debug for Listed<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Listed")
            .field("name", &self.name())
            .finish_non_exhaustive()
    }
}

impl<C: Resource<DynamicType = ()>> Resource for Listed<C> {
    type DynamicType = ();
    type Scope = C::Scope;

    fn kind(dt: &()) -> Cow<'_, str> {
        C::kind(dt)
    }

    fn group(dt: &()) -> Cow<'_, str> {
        C::group(dt)
    }

    fn version(dt: &()) -> Cow<'_, str> {
        C::version(dt)
    }

    fn plural(dt: &()) -> Cow<'_, str> {
        C::plural(dt)
    }

    fn metadata_api() -> bool {
        C::metadata_api()
    }

    fn meta(&self) -> &ObjectMeta {
        &self.meta
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.meta
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::keep_applied;
    use crate::diff::tests::deployment as listed;
    use k8s_openapi::api::apps::v1::Deployment;
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::ResourceExt;
    use serde_json::json;

    fn decoded<C: DeserializeOwned>(v: &Value, manager: &str) -> C {
        let l: Listed<C> = serde_json::from_value(v.clone()).expect("an object");
        l.into_object(manager).expect("a C")
    }

    /// What the typed path cached ([`keep_applied`], then the managed fields dropped).
    fn kept<C: Resource + serde::Serialize + DeserializeOwned>(v: &Value, manager: &str) -> C {
        let mut o: C = serde_json::from_value(v.clone()).expect("a C");
        keep_applied(&mut o, manager);
        o.meta_mut().managed_fields = None;
        o
    }

    #[test]
    fn a_projected_tree_is_what_the_typed_path_kept() {
        let v = listed();
        let d: Deployment = decoded(&v, "opkit-memcached");
        assert_eq!(d, kept::<Deployment>(&v, "opkit-memcached"));
        // Projected: another manager's label, the server's defaults and the managed fields go;
        // identity, owner references and status stay whole.
        assert_eq!(d.labels().get("other"), None);
        let spec = d.spec.as_ref().expect("spec");
        assert_eq!(spec.progress_deadline_seconds, None);
        assert_eq!(spec.replicas, Some(1));
        assert_eq!(d.meta().managed_fields, None);
        assert_eq!(d.owner_references()[0].controller, Some(true));
        assert_eq!(d.meta().resource_version.as_deref(), Some("9"));
        assert_eq!(d.status.as_ref().and_then(|s| s.ready_replicas), Some(1));
        let containers = &spec.template.spec.as_ref().expect("pod spec").containers;
        assert_eq!(containers.len(), 1, "only the container the manager applied");
        let container = &containers[0];
        assert_eq!(container.image.as_deref(), Some("memcached:1.6"));
        assert_eq!(container.image_pull_policy, None);
    }

    #[test]
    fn an_object_the_manager_never_applied_stays_whole_without_its_managed_fields() {
        let v = listed();
        let d: Deployment = decoded(&v, "someone-else");
        let mut whole: Deployment = serde_json::from_value(v.clone()).expect("a Deployment");
        whole.metadata.managed_fields = None;
        assert_eq!(d, whole);
        assert_eq!(d, kept::<Deployment>(&v, "someone-else"));
    }

    #[test]
    fn a_projection_that_makes_no_object_of_the_kind_leaves_it_whole() {
        // A kind whose spec requires a size, and a manager that applied only its colour.
        #[derive(serde::Deserialize, Debug)]
        struct Widget {
            metadata: ObjectMeta,
            spec: WidgetSpec,
        }
        #[derive(serde::Deserialize, Debug)]
        struct WidgetSpec {
            size: i32,
            color: Option<String>,
        }
        let v = json!({"apiVersion": "example.com/v1", "kind": "Widget",
            "metadata": {"name": "w", "managedFields": [{"manager": "m", "operation": "Apply",
                "fieldsType": "FieldsV1", "fieldsV1": {"f:spec": {"f:color": {}}}}]},
            "spec": {"size": 3, "color": "red"}});
        let w: Widget = decoded(&v, "m");
        assert_eq!((w.spec.size, w.spec.color.as_deref()), (3, Some("red")));
        assert_eq!(w.metadata.managed_fields, None);
        assert_eq!(w.metadata.name.as_deref(), Some("w"));
    }

    #[test]
    fn every_event_carries_the_projection() {
        let v = listed();
        let l = || serde_json::from_value::<Listed<Deployment>>(v.clone()).expect("an object");
        assert_eq!(l().meta().resource_version.as_deref(), Some("9"));
        assert_eq!(l().meta().namespace.as_deref(), Some("ns"));
        let want = kept::<Deployment>(&v, "opkit-memcached");
        let none = Cache::from_objects(&crate::Watch::all(), []);
        let undecodable = Counter::default();
        let project = |ev| projected(ev, "opkit-memcached", &none, &undecodable);
        assert!(matches!(
            project(watcher::Event::Init),
            Some(watcher::Event::Init)
        ));
        assert!(matches!(
            project(watcher::Event::InitDone),
            Some(watcher::Event::InitDone)
        ));
        assert!(
            matches!(project(watcher::Event::InitApply(l())), Some(watcher::Event::InitApply(d)) if d == want)
        );
        assert!(matches!(project(watcher::Event::Apply(l())), Some(watcher::Event::Apply(d)) if d == want));
        assert!(matches!(project(watcher::Event::Delete(l())), Some(watcher::Event::Delete(d)) if d == want));
        assert_eq!(undecodable.get(), 0);
    }

    #[test]
    fn an_object_of_another_shape_is_left_out_and_its_deletion_removes_the_cached_copy() {
        // A ConfigMap whose data is no map of strings is no ConfigMap: left out, not a panic.
        let bad = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", "namespace": "ns"}, "data": 3});
        let l = || serde_json::from_value::<Listed<ConfigMap>>(bad.clone()).expect("a tree");
        let mut held = ConfigMap::default();
        held.metadata.name = Some("c".into());
        held.metadata.namespace = Some("ns".into());
        let cache = Cache::from_objects(&crate::Watch::all(), [held]);
        let held = (*cache.get("ns", "c").expect("cached")).clone();
        let undecodable = Counter::default();
        let project = |ev| projected(ev, "m", &cache, &undecodable);
        assert!(project(watcher::Event::Apply(l())).is_none());
        assert!(project(watcher::Event::InitApply(l())).is_none());
        assert!(matches!(project(watcher::Event::Delete(l())), Some(watcher::Event::Delete(c)) if c == held));
        // Not cached: nothing to remove.
        let empty = Cache::from_objects(&crate::Watch::all(), []);
        assert!(projected(watcher::Event::Delete(l()), "m", &empty, &undecodable).is_none());
        // Each left out, and the metric says so.
        assert_eq!(undecodable.get(), 4);
    }

    #[test]
    fn an_apply_entry_without_a_set_owns_nothing() {
        // A second Apply entry of the manager (another API version) with a `null` set.
        let mut v = listed();
        let entries = v["metadata"]["managedFields"].as_array_mut().expect("entries");
        entries.push(
            json!({"manager": "opkit-memcached", "operation": "Apply", "apiVersion": "apps/v1beta2",
            "fieldsType": "FieldsV1", "fieldsV1": null}),
        );
        let d: Deployment = decoded(&v, "opkit-memcached");
        assert_eq!(d, kept::<Deployment>(&v, "opkit-memcached"));
        // Projected on the other entry: the other manager's label is not there.
        assert_eq!(d.labels().get("other"), None);
    }
}
