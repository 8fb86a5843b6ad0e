//! The comparison behind no-op skipping: does the cluster already have what we want?
//!
//! An apply of an unchanged object is a no-op for etcd but still a request the apiserver must
//! authenticate, decode and diff. Comparing the desired fields against the cached live object
//! first means a resync of a converged object costs no API call at all.
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{FieldsV1, ManagedFieldsEntry};
use serde_json::Value;

use crate::changed::{FNV_OFFSET, fnv1a};

/// Whether every field set in `desired` has the same value in `live`.
///
/// Objects are compared key by key (extra keys in `live` — defaults, other managers' fields,
/// `managedFields` — are ignored); arrays must have the same length and match element-wise.
/// A field we stopped setting is not noticed here; it is dropped on the next real change.
pub fn is_subset(desired: &Value, live: &Value) -> bool {
    match (desired, live) {
        (Value::Object(d), Value::Object(l)) => {
            d.iter().all(|(k, dv)| match l.get(k) {
                Some(lv) => is_subset(dv, lv),
                // An empty map or list we ask for is the same as one the server omitted.
                None => is_empty(dv),
            })
        }
        (Value::Array(d), Value::Array(l)) => {
            d.len() == l.len() && d.iter().zip(l).all(|(a, b)| is_subset(a, b))
        }
        (Value::Null, _) => true,
        (d, l) => d == l,
    }
}

/// Whether `desired` and `live` hold the same fields with the same values, a field that is
/// absent, `null` or empty on one side counting as the same on the other. For a status: the
/// controller's field manager owns all of it, so a field the plan stopped setting must be
/// written away (server-side apply then drops it), where [`is_subset`] would keep it.
pub fn same(desired: &Value, live: &Value) -> bool {
    is_subset(desired, live) && is_subset(live, desired)
}

fn is_empty(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Object(m) => m.values().all(is_empty),
        Value::Array(a) => a.is_empty(),
        _ => false,
    }
}

/// Whether applying `desired` over `live` would change anything we manage.
pub fn needs_apply<K: serde::Serialize>(desired: &K, live: Option<&K>) -> bool {
    let Some(live) = live else { return true };
    match (serde_json::to_value(desired), serde_json::to_value(live)) {
        (Ok(d), Ok(l)) => !is_subset(&d, &l),
        _ => true,
    }
}

/// What `manager` applied to `obj`, from its `managedFields`: only the fields that manager
/// owns (the `fieldsV1` of its `Apply` entries), plus what identifies the object (`apiVersion`,
/// `kind`, name, namespace, uid, resourceVersion, generation, timestamps, owner references),
/// the [`CREATED_SHAPE`] annotation and its whole `status`. `None` when the manager applied
/// nothing to it.
///
/// Every field a plan applies is a field its manager owns, so [`is_subset`] of the desired
/// object against this projection answers exactly as against the whole object — and a field
/// another manager took over (`kubectl edit`, a forced apply) drops out of the projection and
/// shows as drift. The server's defaults, other managers' fields and `managedFields` itself are
/// not kept: for a Deployment that is most of the object.
pub fn applied_by(obj: &Value, manager: &str) -> Option<Value> {
    applied_fields(obj, applied_entries(&obj["metadata"]["managedFields"], manager))
}

/// The `fieldsV1` of `manager`'s `Apply` entries among `managedFields`.
pub(crate) fn applied_entries<'a>(managed_fields: &'a Value, manager: &str) -> Vec<&'a Value> {
    let entries = managed_fields.as_array().map(Vec::as_slice).unwrap_or_default();
    let applied = entries.iter().filter(|e| {
        let field = |k: &str| e[k].as_str();
        is_apply_of(
            manager,
            field("manager"),
            field("operation"),
            field("subresource"),
        )
    });
    // A `null` set (which the typed entry reads as none) owns nothing.
    applied
        .filter_map(|e| e.get("fieldsV1").filter(|f| f.is_object()))
        .collect()
}

/// Whether a `managedFields` entry (its manager, operation and subresource) is one of
/// `manager`'s applies to the object itself: a status apply owns no field of the object.
pub(crate) fn is_apply_of(
    manager: &str,
    by: Option<&str>,
    operation: Option<&str>,
    subresource: Option<&str>,
) -> bool {
    is_entry_of(manager, "Apply", by, operation, subresource)
}

/// Whether a `managedFields` entry is `manager`'s, of `operation`, on the object itself.
fn is_entry_of(
    manager: &str,
    operation: &str,
    by: Option<&str>,
    op: Option<&str>,
    subresource: Option<&str>,
) -> bool {
    by == Some(manager) && op == Some(operation) && subresource.unwrap_or_default().is_empty()
}

/// [`applied_by`] with the `fieldsV1` of the manager's `Apply` entries given apart from
/// `obj`, which need not hold its `managedFields` (43% of a memcached Deployment's JSON): a
/// cache takes them out of the object before it projects it.
pub(crate) fn applied_fields<'a>(obj: &Value, applied: impl IntoIterator<Item = &'a Value>) -> Option<Value> {
    let mut owned: Option<Value> = None;
    for fields in applied {
        let projected = project(obj, fields)?;
        owned = Some(match owned {
            Some(mut o) => {
                merge(&mut o, projected);
                o
            }
            None => projected,
        });
    }
    let mut owned = owned?;
    for key in ["apiVersion", "kind", "status"] {
        if let Some(v) = obj.get(key) {
            owned[key] = v.clone();
        }
    }
    for key in [
        "name",
        "namespace",
        "uid",
        "resourceVersion",
        "generation",
        "creationTimestamp",
        "deletionTimestamp",
        "ownerReferences",
    ] {
        if let Some(v) = obj["metadata"].get(key) {
            owned["metadata"][key] = v.clone();
        }
    }
    // Owned by the POST's `Update` entry, read by the plan (`reshaped`).
    if let Some(v) = obj["metadata"]["annotations"].get(CREATED_SHAPE) {
        owned["metadata"]["annotations"][CREATED_SHAPE] = v.clone();
    }
    Some(owned)
}

/// The part of `value` a `fieldsV1` set names (`f:` fields, `k:` keyed and `v:` set list
/// items, `i:` indices; an empty set means the whole value).
pub(crate) fn project(value: &Value, fields: &Value) -> Option<Value> {
    let set = fields.as_object()?;
    let children: Vec<(&String, &Value)> = set.iter().filter(|(k, _)| k.as_str() != ".").collect();
    if children.is_empty() {
        return Some(value.clone());
    }
    match value {
        Value::Object(map) => {
            let mut out = serde_json::Map::new();
            for (k, sub) in children {
                if let Some(name) = k.strip_prefix("f:")
                    && let Some(v) = map.get(name)
                {
                    out.insert(name.to_string(), project(v, sub)?);
                }
            }
            Some(Value::Object(out))
        }
        Value::Array(items) => {
            let mut keep: Vec<(usize, Value)> = Vec::new();
            for (k, sub) in children {
                if let Some(key) = k.strip_prefix("k:") {
                    let key: serde_json::Map<String, Value> = serde_json::from_str(key).ok()?;
                    let Some(i) = items
                        .iter()
                        .position(|it| key.iter().all(|(kk, kv)| it.get(kk) == Some(kv)))
                    else {
                        continue;
                    };
                    let mut item = project(&items[i], sub)?;
                    // The key identifies the item even where the manager left it to a default.
                    if let Value::Object(m) = &mut item {
                        for (kk, kv) in &key {
                            m.entry(kk.clone()).or_insert_with(|| kv.clone());
                        }
                    }
                    keep.push((i, item));
                } else if let Some(v) = k.strip_prefix("v:") {
                    let v: Value = serde_json::from_str(v).ok()?;
                    if let Some(i) = items.iter().position(|it| *it == v) {
                        keep.push((i, v));
                    }
                } else if let Some(i) = k.strip_prefix("i:").and_then(|i| i.parse::<usize>().ok())
                    && let Some(it) = items.get(i)
                {
                    keep.push((i, project(it, sub)?));
                }
            }
            // In the live order: lists are compared element by element.
            keep.sort_by_key(|(i, _)| *i);
            Some(Value::Array(keep.into_iter().map(|(_, v)| v).collect()))
        }
        _ => Some(value.clone()),
    }
}

/// Adds `other`'s fields to `into` (objects merged key by key; anything else replaced).
fn merge(into: &mut Value, other: Value) {
    match (into, other) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in b {
                match a.get_mut(&k) {
                    Some(existing) => merge(existing, v),
                    None => {
                        a.insert(k, v);
                    }
                }
            }
        }
        (into, other) => *into = other,
    }
}

/// The annotation a child created with a POST carries: a hash of which fields were created
/// (every map key, list contents whole).
///
/// A child opkit creates is POSTed (the API server answers that in about half the time of an
/// apply that creates), so its fields belong to opkit's `Update` entry in `managedFields`.
/// Later applies leave a field alone that only that entry owns: one the plan stops setting
/// would stay. While the plan sets the same fields (the same shape), nothing is dropped; once
/// the shape differs, the write path folds the `Update` entry into opkit's `Apply` entry (as
/// kubectl does when it moves an object to server-side apply) and applies again, which drops
/// the field and this annotation.
pub const CREATED_SHAPE: &str = "opkit.dev/created-shape";

/// Whether a child whose [`CREATED_SHAPE`] annotation is `created` was POSTed with other
/// fields than `desired` sets: applying `desired` must fold, even when the child already holds
/// every field. The write path asks after each apply, and the plan asks too, so a fold that did
/// not happen (refused, failed, or the process stopped in between) is made by the next plan.
pub(crate) fn reshaped(created: Option<&str>, desired: &Value) -> bool {
    created.is_some_and(|created| created != shape(desired))
}

/// The [`CREATED_SHAPE`] annotation of `obj` (an object as JSON).
pub(crate) fn created_shape(obj: &Value) -> Option<&str> {
    obj["metadata"]["annotations"][CREATED_SHAPE].as_str()
}

/// Which fields `desired` sets, as a short stable hash: every key of every map, and list
/// contents whole (an item that changes may change the list's keys). Two objects of the same
/// shape own the same fields when applied, whatever their other values.
pub(crate) fn shape(desired: &Value) -> String {
    fn walk(v: &Value, in_list: bool, h: &mut u64) {
        match v {
            Value::Object(m) => {
                *h = fnv1a(*h, b"{");
                let mut keys: Vec<&String> = m.keys().collect();
                keys.sort();
                for k in keys {
                    // Its length first: no two maps write the same bytes.
                    *h = fnv1a(*h, &(k.len() as u64).to_le_bytes());
                    *h = fnv1a(*h, k.as_bytes());
                    walk(&m[k], in_list, h);
                }
                *h = fnv1a(*h, b"}");
            }
            Value::Array(items) => {
                *h = fnv1a(*h, b"[");
                for item in items {
                    walk(item, true, h);
                    *h = fnv1a(*h, b",");
                }
                *h = fnv1a(*h, b"]");
            }
            Value::Null => *h = fnv1a(*h, b"~"),
            scalar if in_list => *h = fnv1a(*h, scalar.to_string().as_bytes()),
            _ => *h = fnv1a(*h, b"="),
        }
    }
    let mut h = FNV_OFFSET;
    walk(desired, false, &mut h);
    format!("{h:016x}")
}

/// `entries` (an object's `managedFields`) with `manager`'s `Update` entries on the object
/// itself folded into its `Apply` entry, as kubectl does when it moves an object from
/// client-side to server-side apply: the next apply then drops what it no longer sets. `None`
/// when the manager has no such `Update` entry.
pub(crate) fn fold_updates(entries: &[ManagedFieldsEntry], manager: &str) -> Option<Vec<ManagedFieldsEntry>> {
    let own = |e: &ManagedFieldsEntry, operation: &str| {
        let (by, op, sub) = (
            e.manager.as_deref(),
            e.operation.as_deref(),
            e.subresource.as_deref(),
        );
        is_entry_of(manager, operation, by, op, sub)
    };
    let updates: Vec<&ManagedFieldsEntry> = entries.iter().filter(|e| own(e, "Update")).collect();
    let first = *updates.first()?;
    let mut folded: Vec<ManagedFieldsEntry> = entries.iter().filter(|e| !own(e, "Update")).cloned().collect();
    let at = match folded.iter().position(|e| own(e, "Apply")) {
        Some(at) => at,
        None => {
            folded.push(ManagedFieldsEntry {
                operation: Some("Apply".into()),
                fields_v1: Some(FieldsV1(Value::Object(Default::default()))),
                ..first.clone()
            });
            folded.len() - 1
        }
    };
    let apply = &mut folded[at];
    let mut fields = apply
        .fields_v1
        .take()
        .map(|f| f.0)
        .unwrap_or_else(|| Value::Object(Default::default()));
    for u in updates {
        if let Some(f) = &u.fields_v1 {
            merge(&mut fields, f.0.clone());
        }
    }
    apply.fields_v1 = Some(FieldsV1(fields));
    Some(folded)
}

/// The `status` of `obj`, serialised alone.
///
/// A no-op reconcile compares the planned status with the live one. Serialising the whole
/// object for that costs its spec, metadata and managed fields on every reconcile; this
/// visits the object's top-level fields and serialises only the one named `status`. `Null`
/// when the object has none.
pub fn status_of<K: serde::Serialize + ?Sized>(obj: &K) -> Value {
    obj.serialize(StatusOnly).ok().flatten().unwrap_or(Value::Null)
}

/// A serializer that keeps one top-level field, `status`, of a struct or a map.
struct StatusOnly;

/// What a top-level shape other than a struct or a map turns into: no status.
fn no_status<T>() -> Result<T, serde_json::Error> {
    Err(serde::ser::Error::custom("not an object"))
}

/// The `status` field, once seen, of a struct or map being serialised.
#[derive(Default)]
struct Picked {
    status: Option<Value>,
    /// The last map key was `status`.
    next_is_status: bool,
}

impl serde::ser::SerializeStruct for Picked {
    type Ok = Option<Value>;
    type Error = serde_json::Error;

    fn serialize_field<T: serde::Serialize + ?Sized>(
        &mut self,
        key: &'static str,
        value: &T,
    ) -> Result<(), Self::Error> {
        if key == "status" {
            self.status = Some(serde_json::to_value(value)?);
        }
        Ok(())
    }

    fn end(self) -> Result<Self::Ok, Self::Error> {
        Ok(self.status)
    }
}

impl serde::ser::SerializeMap for Picked {
    type Ok = Option<Value>;
    type Error = serde_json::Error;

    fn serialize_key<T: serde::Serialize + ?Sized>(&mut self, key: &T) -> Result<(), Self::Error> {
        self.next_is_status = serde_json::to_value(key)? == "status";
        Ok(())
    }

    fn serialize_value<T: serde::Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Self::Error> {
        if std::mem::take(&mut self.next_is_status) {
            self.status = Some(serde_json::to_value(value)?);
        }
        Ok(())
    }

    fn end(self) -> Result<Self::Ok, Self::Error> {
        Ok(self.status)
    }
}

impl serde::Serializer for StatusOnly {
    type Ok = Option<Value>;
    type Error = serde_json::Error;
    type SerializeSeq = serde::ser::Impossible<Self::Ok, Self::Error>;
    type SerializeTuple = serde::ser::Impossible<Self::Ok, Self::Error>;
    type SerializeTupleStruct = serde::ser::Impossible<Self::Ok, Self::Error>;
    type SerializeTupleVariant = serde::ser::Impossible<Self::Ok, Self::Error>;
    type SerializeMap = Picked;
    type SerializeStruct = Picked;
    type SerializeStructVariant = serde::ser::Impossible<Self::Ok, Self::Error>;

    fn serialize_struct(self, _: &'static str, _: usize) -> Result<Picked, Self::Error> {
        Ok(Picked::default())
    }

    fn serialize_map(self, _: Option<usize>) -> Result<Picked, Self::Error> {
        Ok(Picked::default())
    }

    fn serialize_some<T: serde::Serialize + ?Sized>(self, value: &T) -> Result<Self::Ok, Self::Error> {
        value.serialize(self)
    }

    fn serialize_newtype_struct<T: serde::Serialize + ?Sized>(
        self,
        _: &'static str,
        value: &T,
    ) -> Result<Self::Ok, Self::Error> {
        value.serialize(self)
    }

    fn serialize_bool(self, _: bool) -> Result<Self::Ok, Self::Error> {
        no_status()
    }
    fn serialize_i8(self, _: i8) -> Result<Self::Ok, Self::Error> {
        no_status()
    }
    fn serialize_i16(self, _: i16) -> Result<Self::Ok, Self::Error> {
        no_status()
    }
    fn serialize_i32(self, _: i32) -> Result<Self::Ok, Self::Error> {
        no_status()
    }
    fn serialize_i64(self, _: i64) -> Result<Self::Ok, Self::Error> {
        no_status()
    }
    fn serialize_u8(self, _: u8) -> Result<Self::Ok, Self::Error> {
        no_status()
    }
    fn serialize_u16(self, _: u16) -> Result<Self::Ok, Self::Error> {
        no_status()
    }
    fn serialize_u32(self, _: u32) -> Result<Self::Ok, Self::Error> {
        no_status()
    }
    fn serialize_u64(self, _: u64) -> Result<Self::Ok, Self::Error> {
        no_status()
    }
    fn serialize_f32(self, _: f32) -> Result<Self::Ok, Self::Error> {
        no_status()
    }
    fn serialize_f64(self, _: f64) -> Result<Self::Ok, Self::Error> {
        no_status()
    }
    fn serialize_char(self, _: char) -> Result<Self::Ok, Self::Error> {
        no_status()
    }
    fn serialize_str(self, _: &str) -> Result<Self::Ok, Self::Error> {
        no_status()
    }
    fn serialize_bytes(self, _: &[u8]) -> Result<Self::Ok, Self::Error> {
        no_status()
    }
    fn serialize_none(self) -> Result<Self::Ok, Self::Error> {
        Ok(None)
    }
    fn serialize_unit(self) -> Result<Self::Ok, Self::Error> {
        Ok(None)
    }
    fn serialize_unit_struct(self, _: &'static str) -> Result<Self::Ok, Self::Error> {
        Ok(None)
    }
    fn serialize_unit_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
    ) -> Result<Self::Ok, Self::Error> {
        no_status()
    }
    fn serialize_newtype_variant<T: serde::Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: &T,
    ) -> Result<Self::Ok, Self::Error> {
        no_status()
    }
    fn serialize_seq(self, _: Option<usize>) -> Result<Self::SerializeSeq, Self::Error> {
        no_status()
    }
    fn serialize_tuple(self, _: usize) -> Result<Self::SerializeTuple, Self::Error> {
        no_status()
    }
    fn serialize_tuple_struct(
        self,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeTupleStruct, Self::Error> {
        no_status()
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeTupleVariant, Self::Error> {
        no_status()
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeStructVariant, Self::Error> {
        no_status()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use serde_json::json;

    /// A Deployment as the apiserver lists it once opkit applied it: another container, another
    /// manager's label, the controller-manager's status, server defaults.
    pub(crate) fn deployment() -> Value {
        json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "m", "namespace": "ns", "uid": "u", "resourceVersion": "9", "generation": 2,
                "labels": {"app": "memcached", "other": "x"},
                "annotations": {"deployment.kubernetes.io/revision": "1"},
                "ownerReferences": [{"kind": "Memcached", "name": "m", "uid": "o", "controller": true}],
                "managedFields": [
                    {"manager": "opkit-memcached", "operation": "Apply", "apiVersion": "apps/v1", "fieldsType": "FieldsV1",
                     "fieldsV1": {"f:metadata": {"f:labels": {"f:app": {}}, "f:ownerReferences": {"k:{\"uid\":\"o\"}": {}}},
                        "f:spec": {"f:replicas": {}, "f:template": {"f:spec": {"f:containers": {
                            "k:{\"name\":\"memcached\"}": {".": {}, "f:image": {}, "f:name": {},
                                "f:ports": {"k:{\"containerPort\":11211,\"protocol\":\"TCP\"}": {".": {}, "f:containerPort": {}}}}}}}}}},
                    {"manager": "kube-controller-manager", "operation": "Update", "subresource": "status",
                     "fieldsV1": {"f:status": {"f:replicas": {}}}},
                    {"manager": "kubectl-edit", "operation": "Update", "fieldsV1": {"f:metadata": {"f:labels": {"f:other": {}}}}}
                ]},
            "spec": {"replicas": 1, "progressDeadlineSeconds": 600, "template": {"spec": {"dnsPolicy": "ClusterFirst",
                "containers": [
                    {"name": "sidecar", "image": "s"},
                    {"name": "memcached", "image": "memcached:1.6", "imagePullPolicy": "IfNotPresent",
                     "ports": [{"containerPort": 11211, "protocol": "TCP"}]}]}}},
            "status": {"replicas": 1, "readyReplicas": 1}
        })
    }

    #[test]
    fn applied_by_keeps_the_managers_fields_identity_and_status() {
        let p = applied_by(&deployment(), "opkit-memcached").expect("applied");
        assert_eq!(
            p,
            json!({
                "apiVersion": "apps/v1", "kind": "Deployment",
                "metadata": {"name": "m", "namespace": "ns", "uid": "u", "resourceVersion": "9", "generation": 2,
                    "labels": {"app": "memcached"},
                    "ownerReferences": [{"kind": "Memcached", "name": "m", "uid": "o", "controller": true}]},
                "spec": {"replicas": 1, "template": {"spec": {"containers": [
                    {"name": "memcached", "image": "memcached:1.6", "ports": [{"containerPort": 11211, "protocol": "TCP"}]}]}}},
                "status": {"replicas": 1, "readyReplicas": 1}
            })
        );
        let desired = json!({"metadata": {"labels": {"app": "memcached"}}, "spec": {"replicas": 1,
            "template": {"spec": {"containers": [{"name": "memcached", "image": "memcached:1.6",
            "ports": [{"containerPort": 11211}]}]}}}});
        assert!(is_subset(&desired, &p), "what was applied is still there");
        let mut bumped = desired.clone();
        bumped["spec"]["replicas"] = json!(2);
        assert!(!is_subset(&bumped, &p));
    }

    #[test]
    fn a_field_taken_over_by_another_manager_drops_out_and_shows_as_drift() {
        let mut d = deployment();
        // `kubectl scale` took spec.replicas: it is no longer in the manager's set.
        d["metadata"]["managedFields"][0]["fieldsV1"]["f:spec"]
            .as_object_mut()
            .expect("spec fields")
            .remove("f:replicas");
        d["spec"]["replicas"] = json!(5);
        let p = applied_by(&d, "opkit-memcached").expect("applied");
        assert!(p["spec"].get("replicas").is_none());
        assert!(!is_subset(&json!({"spec": {"replicas": 1}}), &p));
    }

    #[test]
    fn nothing_applied_by_the_manager_is_none() {
        assert!(applied_by(&deployment(), "someone-else").is_none());
        assert!(applied_by(&json!({"metadata": {}}), "opkit-memcached").is_none());
    }

    #[test]
    fn defaults_and_foreign_fields_in_live_do_not_count_as_drift() {
        let desired = json!({"spec": {"replicas": 3, "template": {"spec": {"containers": [{"name": "m", "ports": [{"containerPort": 11211}]}]}}}});
        let live = json!({"metadata": {"resourceVersion": "7"}, "spec": {"replicas": 3, "progressDeadlineSeconds": 600,
            "template": {"spec": {"containers": [{"name": "m", "terminationMessagePath": "/dev/termination-log",
            "ports": [{"containerPort": 11211, "protocol": "TCP"}]}]}}}});
        assert!(is_subset(&desired, &live));
    }

    #[test]
    fn changed_values_and_list_lengths_are_drift() {
        let desired = json!({"spec": {"replicas": 3, "args": ["-v"]}});
        assert!(!is_subset(
            &desired,
            &json!({"spec": {"replicas": 5, "args": ["-v"]}})
        ));
        assert!(!is_subset(
            &desired,
            &json!({"spec": {"replicas": 3, "args": ["-v", "-x"]}})
        ));
        assert!(
            !is_subset(&desired, &json!({"spec": {"args": ["-v"]}})),
            "a missing field is drift"
        );
        assert!(
            is_subset(&json!({"spec": {"nodes": []}}), &json!({"spec": {}})),
            "empty equals omitted"
        );
    }

    #[test]
    fn a_field_dropped_from_the_desired_status_is_a_change_an_empty_one_is_not() {
        let live = json!({"active": [{"name": "a"}], "lastRun": "t1", "conditions": []});
        assert!(is_subset(&json!({"lastRun": "t1"}), &live));
        assert!(!same(&json!({"lastRun": "t1"}), &live), "active is no longer set");
        assert!(same(&json!({"lastRun": "t1", "active": [{"name": "a"}]}), &live));
        assert!(same(
            &json!({"lastRun": "t1", "active": [{"name": "a"}], "note": null}),
            &live
        ));
        assert!(!same(&json!({"lastRun": "t2", "active": [{"name": "a"}]}), &live));
    }

    #[test]
    fn status_of_reads_the_status_alone_of_structs_and_maps() {
        use k8s_openapi::api::apps::v1::{Deployment, DeploymentStatus};
        use k8s_openapi::api::core::v1::ConfigMap;
        let mut d = Deployment::default();
        d.metadata.name = Some("d".into());
        assert_eq!(status_of(&d), Value::Null, "no status");
        d.status = Some(DeploymentStatus {
            ready_replicas: Some(2),
            ..Default::default()
        });
        assert_eq!(status_of(&d), json!({"readyReplicas": 2}));
        assert_eq!(status_of(&d), serde_json::to_value(&d).expect("json")["status"]);
        assert_eq!(
            status_of(&ConfigMap::default()),
            Value::Null,
            "a kind without status"
        );
        let dynamic: kube::api::DynamicObject = serde_json::from_value(json!({
            "apiVersion": "example.com/v1", "kind": "Thing", "metadata": {"name": "t"},
            "spec": {"size": 1}, "status": {"ready": true}
        }))
        .expect("object");
        assert_eq!(
            status_of(&dynamic),
            json!({"ready": true}),
            "flattened fields are a map"
        );
        assert_eq!(
            status_of(&json!({"spec": {}, "status": {"a": [1]}})),
            json!({"a": [1]})
        );
        assert_eq!(status_of(&json!([1, 2])), Value::Null, "not an object");
    }

    #[test]
    fn a_shape_is_which_fields_are_set_not_their_values() {
        let d = |replicas: i64, image: &str, labels: Value| {
            json!({"metadata": {"name": "m", "labels": labels}, "spec": {"replicas": replicas,
                "template": {"spec": {"containers": [{"name": "c", "image": image}]}}}})
        };
        let base = shape(&d(1, "a", json!({"x": "1"})));
        assert_eq!(base.len(), 16);
        assert_eq!(
            base,
            shape(&d(3, "a", json!({"x": "2"}))),
            "other values outside lists"
        );
        assert_ne!(base, shape(&d(1, "a", json!({"y": "1"}))), "another key");
        assert_ne!(
            base,
            shape(&d(1, "a", json!({"x": "1", "y": "1"}))),
            "one more key"
        );
        assert_ne!(base, shape(&d(1, "a", json!({}))), "one key fewer");
        assert_ne!(
            base,
            shape(&d(1, "b", json!({"x": "1"}))),
            "a list item's value can be its key"
        );
        let reordered: Value = serde_json::from_str(
            r#"{"spec": {"template": {"spec": {"containers": [{"image": "a", "name": "c"}]}}, "replicas": 1},
                "metadata": {"labels": {"x": "1"}, "name": "m"}}"#,
        )
        .expect("json");
        assert_eq!(base, shape(&reordered), "the order of keys");
        assert_ne!(
            shape(&json!({"x": 1, "y": 1})),
            shape(&json!({"x:=y": 1})),
            "keys that spell another map"
        );
        assert_eq!(
            shape(&json!({"a": 1})),
            "588b6f8848a70bfc",
            "stable across builds"
        );
    }

    #[test]
    fn a_child_posted_with_other_fields_is_reshaped_and_its_projection_says_so() {
        let desired = json!({"metadata": {"labels": {"app": "memcached"}}, "spec": {"replicas": 1}});
        let mut live = deployment();
        assert!(!reshaped(created_shape(&live), &desired), "not created by a POST");
        live["metadata"]["annotations"][CREATED_SHAPE] = json!(shape(&desired));
        assert!(
            !reshaped(created_shape(&live), &desired),
            "the shape it was created with"
        );
        let mut more = desired.clone();
        more["spec"]["paused"] = json!(true);
        assert!(reshaped(created_shape(&live), &more), "one more field");
        // The annotation is the POST's (an `Update` entry's), yet the projection keeps it.
        let projected = applied_by(&live, "opkit-memcached").expect("applied");
        assert!(reshaped(created_shape(&projected), &more));
        assert_eq!(
            projected["metadata"]["annotations"],
            json!({CREATED_SHAPE: shape(&desired)}),
            "no other annotation"
        );
    }

    #[test]
    fn a_managers_update_entry_is_folded_into_its_apply_entry() {
        let entry =
            |manager: &str, operation: &str, subresource: Option<&str>, fields: Value| ManagedFieldsEntry {
                manager: Some(manager.into()),
                operation: Some(operation.into()),
                subresource: subresource.map(Into::into),
                api_version: Some("v1".into()),
                fields_type: Some("FieldsV1".into()),
                fields_v1: Some(FieldsV1(fields)),
                time: None,
            };
        let created = entry(
            "m",
            "Update",
            None,
            json!({"f:data": {".": {}, "f:a": {}, "f:b": {}}}),
        );
        let status = entry("m", "Update", Some("status"), json!({"f:status": {}}));
        let other = entry("kubectl", "Update", None, json!({"f:data": {"f:c": {}}}));
        assert_eq!(
            fold_updates(&[status.clone(), other.clone()], "m"),
            None,
            "nothing to fold"
        );

        let folded = fold_updates(&[created.clone(), status.clone(), other.clone()], "m").expect("folded");
        let apply = entry(
            "m",
            "Apply",
            None,
            json!({"f:data": {".": {}, "f:a": {}, "f:b": {}}}),
        );
        assert_eq!(
            folded,
            vec![status.clone(), other.clone(), apply],
            "an Apply entry made"
        );

        let applied = entry(
            "m",
            "Apply",
            None,
            json!({"f:data": {"f:a": {}}, "f:metadata": {"f:labels": {}}}),
        );
        let folded = fold_updates(&[applied, created, other.clone()], "m").expect("folded");
        let merged = entry(
            "m",
            "Apply",
            None,
            json!({"f:data": {".": {}, "f:a": {}, "f:b": {}}, "f:metadata": {"f:labels": {}}}),
        );
        assert_eq!(folded, vec![merged, other], "into the Apply entry, in its place");
    }
}
