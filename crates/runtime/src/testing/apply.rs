//! Server-side apply as far as a test of a controller needs it: each field manager owns the
//! fields of its last applied configuration; applying again sets them, and removes those it
//! no longer applies unless another manager applies them too. Lists of objects with a `name`
//! merge item by item (containers, ports, env, volumes); `metadata.finalizers` is a set;
//! every other list is atomic. Enough for no-op skipping, pruning of dropped fields and
//! ownership shown in `managedFields`; not the API server's schema-aware merge.
use serde_json::{Map, Value, json};

/// What a list at this position is made of.
enum List {
    /// Objects told apart by their `name`.
    Keyed,
    /// Scalars, each owned on its own (`metadata.finalizers`).
    Set,
    /// Replaced as a whole.
    Atomic,
}

fn list_kind(path: &[&str], items: &[Value]) -> List {
    let names: std::collections::BTreeSet<&str> = items
        .iter()
        .filter_map(|i| i.get("name").and_then(Value::as_str))
        .collect();
    if path == ["metadata", "finalizers"] {
        List::Set
    } else if !items.is_empty() && names.len() == items.len() {
        // Each item named, and no name twice (two mounts of one volume are not one item).
        List::Keyed
    } else {
        List::Atomic
    }
}

fn item<'a>(items: &'a [Value], name: &Value) -> Option<&'a Value> {
    items.iter().find(|i| i.get("name") == Some(name))
}

/// What identifies an object in an applied configuration, not owned by whoever applies it.
pub(crate) fn ownable(applied: &Value) -> Value {
    let mut v = applied.clone();
    if let Some(o) = v.as_object_mut() {
        o.remove("apiVersion");
        o.remove("kind");
        if let Some(m) = o.get_mut("metadata").and_then(Value::as_object_mut) {
            for k in [
                "name",
                "namespace",
                "resourceVersion",
                "uid",
                "generation",
                "managedFields",
            ] {
                m.remove(k);
            }
            if m.is_empty() {
                o.remove("metadata");
            }
        }
    }
    v
}

/// Sets every field of `applied` on `live`.
pub(crate) fn merge(live: &mut Value, applied: &Value) {
    merge_at(live, applied, &mut Vec::new());
}

fn merge_at<'a>(live: &mut Value, applied: &'a Value, path: &mut Vec<&'a str>) {
    match applied {
        Value::Object(fields) => {
            if !live.is_object() {
                *live = json!({});
            }
            for (k, v) in fields {
                path.push(k);
                let slot = live
                    .as_object_mut()
                    .expect("an object")
                    .entry(k.clone())
                    .or_insert(Value::Null);
                merge_at(slot, v, path);
                path.pop();
            }
        }
        // Nothing applied into a list of items others may own leaves it as it is.
        Value::Array(items) if items.is_empty() && live.as_array().is_some_and(|l| !l.is_empty()) => {
            if let (List::Atomic, Some(existing)) = (
                list_kind(path, live.as_array().expect("a list")),
                live.as_array_mut(),
            ) {
                existing.clear();
            }
        }
        Value::Array(items) => match (list_kind(path, items), live.as_array_mut()) {
            (List::Keyed, Some(existing)) => {
                // The applied items in the order applied, each merged into its live one;
                // the items only others applied after them.
                let mut merged = Vec::with_capacity(existing.len().max(items.len()));
                for it in items {
                    let mut slot = match existing.iter().position(|e| e.get("name") == it.get("name")) {
                        Some(i) => existing.remove(i),
                        None => Value::Null,
                    };
                    merge_at(&mut slot, it, path);
                    merged.push(slot);
                }
                merged.append(existing);
                *existing = merged;
            }
            (List::Set, Some(existing)) => {
                for it in items {
                    if !existing.contains(it) {
                        existing.push(it.clone());
                    }
                }
            }
            _ => *live = applied.clone(),
        },
        _ => *live = applied.clone(),
    }
}

/// Removes from `live` what this manager applied before (`old`) and no longer applies
/// (`new`), unless one of `others` (the other managers' configurations) applies it.
pub(crate) fn prune(live: &mut Value, old: &Value, new: &Value, others: &[&Value]) {
    prune_at(live, old, new, others, &mut Vec::new());
}

fn prune_at<'a>(live: &mut Value, old: &'a Value, new: &Value, others: &[&Value], path: &mut Vec<&'a str>) {
    match old {
        Value::Object(fields) => {
            let Some(obj) = live.as_object_mut() else { return };
            for (k, ov) in fields {
                let theirs: Vec<&Value> = others.iter().filter_map(|o| o.get(k)).collect();
                let nv = new.get(k).unwrap_or(&Value::Null);
                if ov.is_object() {
                    // Only the fields applied inside it go; it goes when nothing is left.
                    if let Some(slot) = obj.get_mut(k) {
                        path.push(k);
                        prune_at(slot, ov, nv, &theirs, path);
                        path.pop();
                        if nv.is_null() && slot.as_object().is_some_and(Map::is_empty) {
                            obj.remove(k);
                        }
                    }
                } else if nv.is_null() && theirs.is_empty() {
                    obj.remove(k);
                } else if let Some(slot) = obj.get_mut(k) {
                    path.push(k);
                    prune_at(slot, ov, nv, &theirs, path);
                    path.pop();
                }
            }
        }
        Value::Array(items) => {
            let Some(existing) = live.as_array_mut() else {
                return;
            };
            let empty = Vec::new();
            let new_items = new.as_array().unwrap_or(&empty);
            let their_items: Vec<&Value> = others.iter().filter_map(|o| o.as_array()).flatten().collect();
            match list_kind(path, items) {
                List::Keyed => {
                    for it in items {
                        let name = &it["name"];
                        let theirs: Vec<&Value> = their_items
                            .iter()
                            .copied()
                            .filter(|t| t.get("name") == Some(name))
                            .collect();
                        match item(new_items, name) {
                            None if theirs.is_empty() => existing.retain(|e| e.get("name") != Some(name)),
                            n => {
                                if let Some(slot) = existing.iter_mut().find(|e| e.get("name") == Some(name))
                                {
                                    prune_at(slot, it, n.unwrap_or(&Value::Null), &theirs, path);
                                }
                            }
                        }
                    }
                }
                List::Set => {
                    for it in items {
                        if !new_items.contains(it) && !their_items.contains(&it) {
                            existing.retain(|e| e != it);
                        }
                    }
                }
                List::Atomic => {}
            }
        }
        _ => {}
    }
}

/// Whether applying `applied` would change a value another manager applied (`theirs`): what
/// an unforced apply is refused for.
pub(crate) fn conflicts(applied: &Value, theirs: &Value) -> bool {
    match (applied, theirs) {
        (Value::Object(a), Value::Object(t)) => {
            a.iter().any(|(k, v)| t.get(k).is_some_and(|tv| conflicts(v, tv)))
        }
        (Value::Array(a), Value::Array(t)) if a.iter().chain(t).all(|i| i.get("name").is_some()) => a
            .iter()
            .any(|i| item(t, &i["name"]).is_some_and(|ti| conflicts(i, ti))),
        (a, t) => a != t,
    }
}

/// Takes out of `theirs` (another manager's configuration) the values `applied` sets
/// differently: what a forced apply takes over.
pub(crate) fn take_over(theirs: &mut Value, applied: &Value) {
    match (theirs, applied) {
        (Value::Object(t), Value::Object(a)) => {
            let mut gone = Vec::new();
            for (k, v) in a {
                if let Some(tv) = t.get_mut(k) {
                    if tv.is_object() && v.is_object() {
                        take_over(tv, v);
                        if tv.as_object().is_some_and(Map::is_empty) {
                            gone.push(k.clone());
                        }
                    } else if tv != v && !(tv.is_array() && v.is_array() && both_keyed(tv, v)) {
                        gone.push(k.clone());
                    } else if let (Some(tl), Some(al)) = (tv.as_array_mut(), v.as_array()) {
                        for ti in tl.iter_mut() {
                            if let Some(ai) = item(al, &ti["name"]) {
                                take_over(ti, ai);
                            }
                        }
                    }
                }
            }
            for k in gone {
                t.remove(&k);
            }
        }
        (t, a) if t != a => *t = Value::Null,
        _ => {}
    }
}

fn both_keyed(a: &Value, b: &Value) -> bool {
    let keyed = |v: &Value| {
        matches!(
            list_kind(&[], v.as_array().map(Vec::as_slice).unwrap_or_default()),
            List::Keyed
        )
    };
    keyed(a) && keyed(b)
}

/// The fields that differ from `old` in `new`: their new values, `null` for those removed.
/// Lists are compared whole.
pub(crate) fn changed(old: &Value, new: &Value) -> Value {
    match (old, new) {
        (Value::Object(o), Value::Object(n)) => {
            let mut out = Map::new();
            for (k, nv) in n {
                match o.get(k) {
                    Some(ov) if ov == nv => {}
                    Some(ov) if ov.is_object() && nv.is_object() => {
                        out.insert(k.clone(), changed(ov, nv));
                    }
                    _ => {
                        out.insert(k.clone(), nv.clone());
                    }
                }
            }
            for k in o.keys().filter(|k| !n.contains_key(*k)) {
                out.insert(k.clone(), Value::Null);
            }
            Value::Object(out)
        }
        _ => new.clone(),
    }
}

/// `v` without the fields that are `null` (removed, so owned by no one).
pub(crate) fn without_nulls(v: &Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(
            m.iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k.clone(), without_nulls(v)))
                .collect(),
        ),
        other => other.clone(),
    }
}

/// The `fieldsV1` set of an applied configuration, as `managedFields` shows it.
pub(crate) fn fields_v1(applied: &Value) -> Value {
    fields_at(applied, &mut Vec::new())
}

fn fields_at<'a>(v: &'a Value, path: &mut Vec<&'a str>) -> Value {
    let mut set = Map::new();
    match v {
        Value::Object(fields) => {
            for (k, sub) in fields {
                path.push(k);
                set.insert(format!("f:{k}"), fields_at(sub, path));
                path.pop();
            }
        }
        Value::Array(items) => match list_kind(path, items) {
            List::Keyed => {
                for it in items {
                    let key = json!({"name": it["name"]}).to_string();
                    let mut sub = fields_at(it, path);
                    sub.as_object_mut()
                        .expect("an object")
                        .insert(".".into(), json!({}));
                    set.insert(format!("k:{key}"), sub);
                }
            }
            List::Set => {
                for it in items {
                    set.insert(format!("v:{it}"), json!({}));
                }
            }
            List::Atomic => {}
        },
        _ => {}
    }
    Value::Object(set)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn apply(live: &mut Value, old: &Value, new: &Value, others: &[&Value]) {
        prune(live, old, new, others);
        merge(live, new);
    }

    #[test]
    fn a_field_no_longer_applied_goes_unless_another_manager_applies_it() {
        let a1 = json!({"spec": {"replicas": 1, "paused": true}, "metadata": {"labels": {"x": "1"}}});
        let b = json!({"spec": {"paused": true}});
        let mut live = json!({"metadata": {"name": "d"}});
        apply(&mut live, &Value::Null, &a1, &[&b]);
        merge(&mut live, &b);
        let a2 = json!({"spec": {"replicas": 2}});
        apply(&mut live, &a1, &a2, &[&b]);
        assert_eq!(
            live,
            json!({"metadata": {"name": "d"}, "spec": {"replicas": 2, "paused": true}})
        );
    }

    #[test]
    fn named_items_merge_and_finalizers_are_a_set() {
        let mut live = json!({"metadata": {"finalizers": ["theirs"]}, "spec": {"containers": [{"name": "a", "image": "x", "args": ["1"]}]}});
        let old = json!({"spec": {"containers": [{"name": "a", "image": "x", "args": ["1"]}, {"name": "b", "image": "y"}]}});
        let new = json!({"metadata": {"finalizers": ["ours"]}, "spec": {"containers": [{"name": "a", "image": "z"}]}});
        apply(&mut live, &old, &new, &[]);
        assert_eq!(
            live,
            json!({"metadata": {"finalizers": ["theirs", "ours"]}, "spec": {"containers": [{"name": "a", "image": "z"}]}})
        );
        let none = json!({"metadata": {"finalizers": []}});
        apply(&mut live, &new, &none, &[]);
        assert_eq!(live["metadata"]["finalizers"], json!(["theirs"]));
        assert_eq!(
            fields_v1(&new),
            json!({"f:metadata": {"f:finalizers": {"v:\"ours\"": {}}}, "f:spec": {"f:containers": {"k:{\"name\":\"a\"}": {".": {}, "f:image": {}, "f:name": {}}}}})
        );
    }

    #[test]
    fn an_item_added_mid_list_takes_its_applied_place_and_duplicate_names_are_atomic() {
        let old = json!({"env": [{"name": "A", "value": "1"}, {"name": "C", "value": "3"}]});
        let mut live = old.clone();
        let new = json!({"env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}, {"name": "C", "value": "3"}]});
        apply(&mut live, &old, &new, &[]);
        assert_eq!(live, new);
        let mounts = json!({"m": [{"name": "v", "mountPath": "/a"}, {"name": "v", "mountPath": "/b"}]});
        let mut live = json!({});
        apply(&mut live, &Value::Null, &mounts, &[]);
        apply(&mut live, &mounts, &mounts, &[]);
        assert_eq!(live, mounts);
    }

    #[test]
    fn a_forced_apply_takes_the_fields_it_sets_differently() {
        let mut theirs = json!({"spec": {"replicas": 5, "paused": true, "containers": [{"name": "a", "image": "x", "args": ["1"]}]}});
        take_over(
            &mut theirs,
            &json!({"spec": {"replicas": 3, "paused": true, "containers": [{"name": "a", "image": "y"}]}}),
        );
        assert_eq!(
            theirs,
            json!({"spec": {"paused": true, "containers": [{"name": "a", "args": ["1"]}]}})
        );
    }

    #[test]
    fn a_write_other_than_apply_owns_what_it_changed() {
        let old = json!({"spec": {"replicas": 3, "paused": true, "template": {"x": 1}}});
        let new = json!({"spec": {"replicas": 5, "template": {"x": 1}}});
        let c = changed(&old, &new);
        assert_eq!(c, json!({"spec": {"replicas": 5, "paused": null}}));
        assert_eq!(without_nulls(&c), json!({"spec": {"replicas": 5}}));
        let mut theirs = json!({"spec": {"replicas": 3, "paused": true, "template": {"x": 1}}});
        take_over(&mut theirs, &c);
        assert_eq!(theirs, json!({"spec": {"template": {"x": 1}}}));
    }

    #[test]
    fn an_unforced_apply_conflicts_only_on_a_different_value() {
        let theirs = json!({"spec": {"replicas": 3, "containers": [{"name": "a", "image": "x"}]}});
        assert!(!conflicts(&json!({"spec": {"replicas": 3}}), &theirs));
        assert!(conflicts(&json!({"spec": {"replicas": 4}}), &theirs));
        assert!(conflicts(
            &json!({"spec": {"containers": [{"name": "a", "image": "y"}]}}),
            &theirs
        ));
        assert!(!conflicts(
            &json!({"spec": {"containers": [{"name": "b", "image": "y"}]}}),
            &theirs
        ));
    }
}
