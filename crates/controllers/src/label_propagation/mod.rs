//! The label-propagation controller: a Namespace annotated
//! `labels.opkit.dev/propagate: team,cost-center` has those of its labels copied onto every
//! object in it of the kinds named when the operator runs (`--label-propagation-resources
//! deployments.v1.apps,configmaps.v1`): kinds the operator was not built with, found by
//! discovery, watched from when they are installed until they go.
//!
//! observe (the Namespace, and each kind's cached objects in it) → plan (pure: for each object,
//! the labels it should carry; a merge patch of the version seen where they differ, recording
//! the keys copied in [`PROPAGATED`]) → opkit patches, so taking a key off the annotation, or
//! the label off the Namespace, removes exactly what was copied and nothing someone else set;
//! an object deleted meanwhile is not made again.
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::rbac::v1::PolicyRule;
use k8s_openapi::jiff::Timestamp;
use kube::core::DynamicObject;
use kube::runtime::reflector::ObjectRef;
use kube::{Client, ResourceExt};
use opkit::rbac::{events, rule};
use opkit::{
    Child, DynamicCache, DynamicKind, Event, Invalid, Plan, Reconciler, Requeue, ResolvedKind, Watch,
    Watches, changed,
};
use serde_json::json;

/// The controller's name (`--controllers labelpropagation`) and metrics label.
pub const NAME: &str = "labelpropagation";
/// The operator flag naming the kinds it acts on.
pub const FLAG: &str = "label-propagation-resources";
/// The Namespace annotation listing the label keys to copy, comma-separated.
pub const PROPAGATE: &str = "labels.opkit.dev/propagate";
/// The annotation on each object listing the keys copied onto it: what the next change of the
/// Namespace may change or take away.
pub const PROPAGATED: &str = "labels.opkit.dev/propagated";

/// Event reasons.
pub mod reason {
    pub const PROPAGATED: &str = "LabelsPropagated";
    pub const INVALID_KEY: &str = "InvalidLabelKey";
    pub const CONFLICT: &str = "LabelConflict";
}

/// Copies a Namespace's chosen labels onto the objects of `kinds` in it.
#[derive(Clone, Debug, Default)]
pub struct LabelPropagationController {
    /// The kinds whose objects get the labels.
    pub kinds: Vec<DynamicKind>,
}

/// The API access of the controller itself; the kinds it is given at run time need `list`,
/// `watch` and `patch` besides ([`verbs`]), which the chart grants from its values.
pub fn rbac_rules() -> Vec<PolicyRule> {
    vec![rule(&[""], &["namespaces"], &["list", "watch"]), events()]
}

/// What the controller does with the kinds it is given: the chart grants these on each.
pub const VERBS: &[&str] = &["list", "watch", "patch"];

/// Each kind's cached objects in one Namespace, with the kind as discovery found it.
pub type Objects = Vec<(ResolvedKind, Vec<Arc<DynamicObject>>)>;

impl Reconciler for LabelPropagationController {
    type Object = Namespace;
    type Caches = Vec<DynamicCache>;
    type World = Objects;
    type Status = ();

    fn name(&self) -> &'static str {
        NAME
    }

    fn primary(&self) -> Watch<Namespace> {
        Watch::all()
            .on_change(|ns: &Namespace| (changed::labels(ns), ns.annotations().get(PROPAGATE).cloned()))
    }

    fn watch(&self, w: &mut Watches<Namespace>) -> Vec<DynamicCache> {
        self.kinds
            .iter()
            .map(|kind| {
                let watch = Watch::all()
                    // Only metadata is read: the rest of each object stays out of memory.
                    .trim(|o: &mut DynamicObject| o.data = serde_json::Value::Null)
                    .on_change(|o: &DynamicObject| {
                        (changed::labels(o), o.annotations().get(PROPAGATED).cloned())
                    });
                w.dynamic(kind, watch, |o| o.namespace().map(|ns| ObjectRef::new(&ns)))
            })
            .collect()
    }

    async fn observe(&self, ns: &Namespace, caches: &Vec<DynamicCache>, _: &Client) -> kube::Result<Objects> {
        let name = ns.name_any();
        Ok(caches
            .iter()
            .filter_map(|c| {
                let kind = c.kind()?;
                Some((
                    kind,
                    c.filter(|o| o.metadata.namespace.as_deref() == Some(name.as_str())),
                ))
            })
            .collect())
    }

    fn plan(&self, ns: &Namespace, objects: &Objects, _: Timestamp) -> Result<Plan<()>, Invalid> {
        Ok(plan(ns, objects))
    }
}

/// The labels `ns` asks to copy, and the Events about keys it cannot.
fn wanted(ns: &Namespace) -> (BTreeMap<String, String>, Vec<Event>) {
    let (mut labels, mut events) = (BTreeMap::new(), Vec::new());
    let listed = ns.annotations().get(PROPAGATE).cloned().unwrap_or_default();
    for key in listed.split(',').map(str::trim).filter(|k| !k.is_empty()) {
        if !valid_key(key) {
            events.push(Event::warning(
                reason::INVALID_KEY,
                "Propagate",
                format!("{PROPAGATE} names {key:?}, which is not a label key (an optional DNS prefix and '/', then up to 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit)"),
            ));
        } else if let Some(value) = ns.labels().get(key) {
            labels.insert(key.to_string(), value.clone());
        }
    }
    (labels, events)
}

/// What `ns`'s objects should carry, as merge patches where they do not. Only labels an
/// object does not have yet are copied (and recorded in [`PROPAGATED`]); one someone else
/// set is theirs: left alone, with a Warning when its value differs.
pub fn plan(ns: &Namespace, objects: &Objects) -> Plan<()> {
    let (labels, mut events) = wanted(ns);
    let mut plan = Plan::nothing(Requeue::OnChange);
    let (mut changed, mut taken) = (0, Vec::new());
    for (kind, objs) in objects {
        for o in objs.iter().filter(|o| o.metadata.deletion_timestamp.is_none()) {
            let copied: BTreeSet<&str> = o
                .annotations()
                .get(PROPAGATED)
                .map(|a| a.split(',').filter(|k| !k.is_empty()).collect())
                .unwrap_or_default();
            let mut mine = labels.clone();
            mine.retain(|k, v| {
                let theirs = !copied.contains(k.as_str()) && o.labels().contains_key(k);
                if theirs && o.labels().get(k) != Some(v) {
                    taken.push(format!("{k} on {} {}", kind.resource().kind, o.name_any()));
                }
                !theirs
            });
            let mut patch = serde_json::Map::new();
            for k in &copied {
                if !mine.contains_key(*k) {
                    patch.insert(k.to_string(), serde_json::Value::Null);
                }
            }
            for (k, v) in &mine {
                patch.insert(k.clone(), json!(v));
            }
            let keys: Vec<&str> = mine.keys().map(String::as_str).collect();
            let record = (!keys.is_empty()).then(|| keys.join(","));
            let patch = json!({"metadata": {"labels": patch, "annotations": { PROPAGATED: record }}});
            let child = Child::merge_dynamic(kind, o, patch);
            if child.is_needed() {
                changed += 1;
                plan = plan.child(child);
            }
        }
    }
    if changed > 0 {
        let shown: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let note = match shown.is_empty() {
            true => format!("removed the propagated labels from {changed} object(s)"),
            false => format!("{} on {changed} object(s)", shown.join(", ")),
        };
        plan = plan.event(Event::normal(reason::PROPAGATED, "Propagate", note));
    }
    if !taken.is_empty() {
        let more = taken.len().saturating_sub(5);
        taken.truncate(5);
        let more = if more > 0 {
            format!(" and {more} more")
        } else {
            String::new()
        };
        events.push(Event::warning(
            reason::CONFLICT,
            "Propagate",
            format!(
                "left alone, set by someone else to another value: {}{more}",
                taken.join(", ")
            ),
        ));
    }
    events.into_iter().fold(plan, Plan::event)
}

/// A label key: an optional DNS-subdomain prefix and `/`, then a name of up to 63
/// characters.
fn valid_key(key: &str) -> bool {
    let (prefix, name) = match key.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    let alnum = |c: char| c.is_ascii_alphanumeric();
    let name_ok = !name.is_empty()
        && name.len() <= 63
        && name.starts_with(alnum)
        && name.ends_with(alnum)
        && name.chars().all(|c| alnum(c) || matches!(c, '-' | '_' | '.'));
    let prefix_ok = prefix.is_none_or(|p| {
        !p.is_empty()
            && p.len() <= 253
            && p.split('.').all(|l| {
                !l.is_empty()
                    && l.starts_with(alnum)
                    && l.ends_with(alnum)
                    && l.chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            })
    });
    name_ok && prefix_ok
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::core::ApiResource;

    fn namespace(labels: &[(&str, &str)], propagate: Option<&str>) -> Namespace {
        let mut ns = Namespace::default();
        ns.metadata.name = Some("team-a".into());
        ns.metadata.labels = Some(
            labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        );
        if let Some(p) = propagate {
            ns.metadata.annotations = Some([(PROPAGATE.to_string(), p.to_string())].into());
        }
        ns
    }

    fn object(name: &str, labels: &[(&str, &str)], copied: Option<&str>) -> Arc<DynamicObject> {
        let mut meta =
            serde_json::json!({"name": name, "namespace": "team-a", "resourceVersion": "5", "labels": {}});
        for (k, v) in labels {
            meta["labels"][k] = serde_json::json!(v);
        }
        if let Some(c) = copied {
            meta["annotations"] = serde_json::json!({ PROPAGATED: c });
        }
        Arc::new(
            serde_json::from_value(
                serde_json::json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta}),
            )
            .expect("object"),
        )
    }

    fn configmaps(objs: Vec<Arc<DynamicObject>>) -> Objects {
        let ar = ApiResource {
            group: String::new(),
            version: "v1".into(),
            api_version: "v1".into(),
            kind: "ConfigMap".into(),
            plural: "configmaps".into(),
        };
        vec![(ResolvedKind::new(ar, true), objs)]
    }

    fn bodies(plan: &Plan<()>) -> Vec<serde_json::Value> {
        plan.children
            .iter()
            .filter(|c| c.is_needed())
            .map(|c| serde_json::to_value(c.body()).expect("body"))
            .collect()
    }

    #[test]
    fn listed_labels_are_copied_once_and_then_left_alone() {
        let ns = namespace(
            &[("team", "a"), ("cost-center", "7"), ("other", "x")],
            Some("team, cost-center"),
        );
        let plan = plan(
            &ns,
            &configmaps(vec![object("settings", &[("app", "web")], None)]),
        );
        let body = &bodies(&plan)[0];
        assert_eq!(plan.children[0].name(), "settings");
        assert_eq!(body["metadata"]["resourceVersion"], "5", "of the version seen");
        assert_eq!(
            body["metadata"]["labels"],
            serde_json::json!({"team": "a", "cost-center": "7"})
        );
        assert_eq!(body["metadata"]["annotations"][PROPAGATED], "cost-center,team");
        assert_eq!(plan.events.len(), 1);
        let done = object(
            "settings",
            &[("app", "web"), ("team", "a"), ("cost-center", "7")],
            Some("cost-center,team"),
        );
        let plan = super::plan(&ns, &configmaps(vec![done]));
        assert!(bodies(&plan).is_empty(), "labels in place: nothing to write");
        assert!(plan.events.is_empty(), "and nothing to say");
    }

    #[test]
    fn a_changed_value_is_copied_and_a_dropped_key_taken_away() {
        let carrying = object(
            "settings",
            &[("team", "a"), ("cost-center", "7")],
            Some("cost-center,team"),
        );
        let ns = namespace(&[("team", "b"), ("cost-center", "7")], Some("team,cost-center"));
        let body = &bodies(&plan(&ns, &configmaps(vec![carrying.clone()])))[0];
        assert_eq!(body["metadata"]["labels"]["team"], "b");
        let ns = namespace(&[("team", "a"), ("cost-center", "7")], Some("team"));
        let body = &bodies(&plan(&ns, &configmaps(vec![carrying.clone()])))[0];
        assert_eq!(
            body["metadata"]["labels"],
            serde_json::json!({"team": "a", "cost-center": null})
        );
        assert_eq!(body["metadata"]["annotations"][PROPAGATED], "team");
        // Nothing left to copy: what was copied goes, and the record of it.
        let ns = namespace(&[("team", "a")], None);
        let body = &bodies(&plan(&ns, &configmaps(vec![carrying])))[0];
        assert_eq!(
            body["metadata"]["labels"],
            serde_json::json!({"team": null, "cost-center": null})
        );
        assert!(body["metadata"]["annotations"][PROPAGATED].is_null(), "{body}");
    }

    #[test]
    fn a_label_someone_else_set_is_theirs() {
        // The object carries team=a, not from this controller: left as it is, and not recorded
        // as copied (taking the key off the annotation must not remove it).
        let same = object("settings", &[("team", "a")], None);
        let ns = namespace(&[("team", "a")], Some("team"));
        let plan = plan(&ns, &configmaps(vec![same]));
        assert!(bodies(&plan).is_empty(), "{:?}", bodies(&plan));
        assert!(plan.events.is_empty(), "{:?}", plan.events);
        // Someone set team=z: theirs, left alone, and said so.
        let other = object("settings", &[("team", "z")], None);
        let plan = super::plan(&ns, &configmaps(vec![other]));
        assert!(bodies(&plan).is_empty(), "{:?}", bodies(&plan));
        let warning = plan
            .events
            .iter()
            .find(|e| e.reason == reason::CONFLICT)
            .expect("a warning");
        assert!(
            warning.note.contains("team on ConfigMap settings"),
            "{}",
            warning.note
        );
        // A value this controller copied and someone changed is put back.
        let drifted = object("settings", &[("team", "z")], Some("team"));
        let plan = super::plan(&ns, &configmaps(vec![drifted]));
        assert_eq!(
            bodies(&plan)[0]["metadata"]["labels"],
            serde_json::json!({"team": "a"})
        );
        // Nothing asked and nothing copied: nothing written, whatever labels it has.
        let ns = namespace(&[("team", "a")], None);
        let plan = super::plan(&ns, &configmaps(vec![object("settings", &[("team", "z")], None)]));
        assert!(bodies(&plan).is_empty());
        assert!(plan.events.is_empty());
    }

    #[test]
    fn a_key_that_is_not_a_label_key_is_refused_with_a_warning() {
        let ns = namespace(&[("team", "a")], Some("team,Not A Key,-x"));
        let plan = plan(&ns, &configmaps(vec![object("settings", &[], None)]));
        let warnings: Vec<&Event> = plan
            .events
            .iter()
            .filter(|e| e.reason == reason::INVALID_KEY)
            .collect();
        assert_eq!(warnings.len(), 2, "{:?}", plan.events);
        assert!(warnings[0].note.contains("\"Not A Key\""), "{}", warnings[0].note);
        assert_eq!(
            bodies(&plan)[0]["metadata"]["labels"],
            serde_json::json!({"team": "a"})
        );
        for ok in ["team", "app.kubernetes.io/name", "a_b.c-d", "example.com/x"] {
            assert!(valid_key(ok), "{ok}");
        }
        for bad in ["", "-a", "a-", "Example.com/x", "/x", &"x".repeat(64)] {
            assert!(!valid_key(bad), "{bad}");
        }
    }

    #[test]
    fn objects_being_deleted_are_left_alone() {
        let ns = namespace(&[("team", "a")], Some("team"));
        let mut going = (*object("settings", &[], None)).clone();
        going.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            Timestamp::UNIX_EPOCH,
        ));
        assert!(bodies(&plan(&ns, &configmaps(vec![Arc::new(going)]))).is_empty());
    }
}
