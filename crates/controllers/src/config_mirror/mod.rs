//! The ConfigMirror controller: a cluster-scoped `ConfigMirror` copies one ConfigMap into every
//! namespace whose labels match its selector; copies follow the source, namespaces that appear
//! or are relabelled, and hand edits; deleting the mirror removes every copy first.
//!
//! observe (caches: the source, the namespaces, the copies) → plan (pure: validate → targets →
//! copies → status) or, while the mirror is being deleted, cleanup (pure: delete every copy);
//! opkit applies the copies, prunes copies in namespaces no longer selected, keeps the
//! finalizer and writes the status.
pub mod select;
mod webhook;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use k8s_openapi::api::rbac::v1::PolicyRule;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::runtime::reflector::ObjectRef;
use kube::{Client, Resource, ResourceExt};
use opkit::conditions::{self, Desired};
use opkit::rbac::{events, rule};
use opkit::{
    Cache, Child, Cleanup, Deletion, Event, Invalid, Plan, Reconciler, Requeue, Tuning, Watch, Watches,
    changed,
};
use opkit_api::MANAGED_BY;
use opkit_api::config_mirror::{ConfigMirror, ConfigMirrorStatus};

pub use webhook::{validate_spec, webhooks};

/// The controller's name (`--controllers configmirror`), metrics label and finalizer suffix.
pub const NAME: &str = "configmirror";
/// Label on every copy naming its mirror.
pub const MIRROR_LABEL: &str = "mirror.opkit.dev/mirror";

/// Condition types.
pub mod condition {
    pub const READY: &str = "Ready";
}

/// Condition and Event reasons.
pub mod reason {
    pub const SYNCED: &str = "Synced";
    pub const SOURCE_NOT_FOUND: &str = "SourceNotFound";
    pub const CONFLICT: &str = "NameTaken";
    pub const INVALID_SPEC: &str = "InvalidSpec";
    pub const COPIED: &str = "Copied";
    pub const REMOVED: &str = "CopiesRemoved";
}

/// The primary index of mirrors by their source (`namespace/name`).
const BY_SOURCE: &str = "source";
/// The ConfigMap index of copies by mirror name.
const BY_MIRROR: &str = "mirror";

/// The ConfigMirror reconciler.
#[derive(Clone, Copy, Debug, Default)]
pub struct ConfigMirrorController;

/// The API access this controller uses, for the generated ClusterRole.
pub fn rbac_rules() -> Vec<PolicyRule> {
    vec![
        // `patch` adds and removes the finalizer (server-side apply of that one entry).
        rule(
            &["mirror.opkit.dev"],
            &["configmirrors"],
            &["list", "watch", "patch"],
        ),
        rule(&["mirror.opkit.dev"], &["configmirrors/status"], &["patch"]),
        rule(&[""], &["namespaces"], &["list", "watch"]),
        // `create`: an apply that makes a copy is authorized as a create too.
        rule(
            &[""],
            &["configmaps"],
            &["list", "watch", "create", "patch", "delete"],
        ),
        events(),
    ]
}

/// The caches: every namespace, every ConfigMap (sources and copies).
pub struct Caches {
    namespaces: Cache<Namespace>,
    configmaps: Cache<ConfigMap>,
}

/// What the plan reads about one mirror.
#[derive(Clone, Debug, Default)]
pub struct World {
    /// The source ConfigMap, if it exists.
    pub source: Option<Arc<ConfigMap>>,
    /// Every namespace.
    pub namespaces: Vec<Arc<Namespace>>,
    /// The ConfigMaps named like the source in other namespaces: copies of this mirror, or
    /// someone else's, by namespace.
    pub named: BTreeMap<String, Arc<ConfigMap>>,
    /// Copies this mirror controls, wherever they are.
    pub copies: Vec<Arc<ConfigMap>>,
}

fn source_key(m: &ConfigMirror) -> String {
    format!("{}/{}", m.spec.source.namespace, m.spec.source.name)
}

/// Whether `cm` is controlled by the mirror of `uid`.
fn controlled_by(cm: &ConfigMap, uid: &str) -> bool {
    cm.owner_references()
        .iter()
        .any(|o| o.controller == Some(true) && o.uid == uid)
}

/// The copy of `source` for namespace `ns`, owned by `mirror`.
pub fn build_copy(mirror: &ConfigMirror, source: &ConfigMap, ns: &str) -> ConfigMap {
    let labels = BTreeMap::from([
        ("app.kubernetes.io/managed-by".to_string(), MANAGED_BY.to_string()),
        (MIRROR_LABEL.to_string(), mirror.name_any()),
    ]);
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(mirror.spec.source.name.clone()),
            namespace: Some(ns.into()),
            labels: Some(labels),
            // A cluster-scoped owner may own namespaced objects: the garbage collector also
            // removes copies whose mirror is gone without its finalizer (removed by hand).
            owner_references: mirror.controller_owner_ref(&()).map(|o| vec![o]),
            ..Default::default()
        },
        data: source.data.clone(),
        binary_data: source.binary_data.clone(),
        ..Default::default()
    }
}

impl Reconciler for ConfigMirrorController {
    type Object = ConfigMirror;
    type Caches = Caches;
    type World = World;
    type Status = ConfigMirrorStatus;

    fn name(&self) -> &'static str {
        NAME
    }

    /// One reconcile writes a copy into every selected namespace, one request after another:
    /// fewer at once than the default keeps a burst of new mirrors from crowding out the other
    /// controllers' requests, and a longer timeout lets one mirror reach hundreds of namespaces.
    fn tuning(&self, defaults: Tuning) -> Tuning {
        Tuning {
            concurrency: 4,
            timeout: Duration::from_secs(180),
            ..defaults
        }
    }

    fn watch(&self, w: &mut Watches<ConfigMirror>) -> Caches {
        w.index_primary(BY_SOURCE, |m: &ConfigMirror| Some(source_key(m)));
        let mirrors = w.primary();
        // A namespace matters when it appears, goes, is relabelled or starts terminating.
        let namespaces = w.watches(
            Watch::all().on_change(|n: &Namespace| (changed::labels(n), changed::deletion(n))),
            move |_: Namespace| {
                mirrors
                    .all()
                    .iter()
                    .map(|m| ObjectRef::from_obj(m.as_ref()))
                    .collect::<Vec<_>>()
            },
        );
        let mirrors = w.primary();
        let configmaps = w.watches(
            Watch::all()
                .index(BY_MIRROR, |c: &ConfigMap| c.labels().get(MIRROR_LABEL).cloned())
                .on_change(|c: &ConfigMap| {
                    let binary = c.binary_data.as_ref().map(|b| {
                        b.iter()
                            .map(|(k, v)| (k.clone(), v.0.clone()))
                            .collect::<BTreeMap<_, _>>()
                    });
                    (c.data.clone(), binary, changed::labels(c), changed::deletion(c))
                })
                .prune(),
            move |c: ConfigMap| {
                // A source changed: its mirrors; a copy changed: its mirror.
                let key = format!("{}/{}", c.namespace().unwrap_or_default(), c.name_any());
                let mut refs = mirrors.indexed_refs(BY_SOURCE, &key);
                refs.extend(c.labels().get(MIRROR_LABEL).map(|m| ObjectRef::new(m)));
                refs
            },
        );
        Caches {
            namespaces,
            configmaps,
        }
    }

    async fn observe(&self, m: &ConfigMirror, cache: &Caches, _: &Client) -> kube::Result<World> {
        let uid = m.uid().unwrap_or_default();
        let source = &m.spec.source;
        let namespaces = cache.namespaces.all();
        let named = namespaces
            .iter()
            .filter_map(|n| {
                let ns = n.name_any();
                let cm = cache.configmaps.get(&ns, &source.name)?;
                Some((ns, cm))
            })
            .filter(|(ns, _)| *ns != source.namespace)
            .collect();
        Ok(World {
            source: cache.configmaps.get(&source.namespace, &source.name),
            namespaces,
            named,
            copies: cache
                .configmaps
                .indexed(BY_MIRROR, &m.name_any())
                .into_iter()
                .filter(|c| controlled_by(c, &uid))
                .collect(),
        })
    }

    fn plan(
        &self,
        m: &ConfigMirror,
        world: &World,
        now: Timestamp,
    ) -> Result<Plan<ConfigMirrorStatus>, Invalid> {
        validate_spec(&m.spec)
            .map_err(|message| Invalid::new(condition::READY, false, reason::INVALID_SPEC, message))?;
        let uid = m.uid().unwrap_or_default();
        let live = m.status.clone().unwrap_or_default();
        let generation = m.metadata.generation;
        let status = |namespaces: Vec<String>, ready: Desired<'static>| ConfigMirrorStatus {
            synced_count: i32::try_from(namespaces.len()).unwrap_or(i32::MAX),
            namespaces,
            observed_generation: generation,
            conditions: conditions::merge(&live.conditions, &[ready], generation, &Time(now)),
        };
        // Routine changes come through the watches; the hourly look is a safety net.
        let hourly = Requeue::After(Duration::from_secs(3600));
        let Some(source) = &world.source else {
            // Without a source the copies stay as they are (a source being replaced should not
            // empty every namespace); the condition says why nothing is synced.
            let kept: Vec<Child> = world
                .copies
                .iter()
                .map(|c| Child::apply(c.as_ref(), Some(c.as_ref())))
                .collect();
            let message = format!("ConfigMap {} does not exist", source_key(m));
            let mut plan = Plan::status(
                status(
                    Vec::new(),
                    Desired::no(condition::READY, reason::SOURCE_NOT_FOUND, message.clone()),
                ),
                hourly,
            );
            if flips(&live, reason::SOURCE_NOT_FOUND) {
                plan = plan.event(Event::warning(reason::SOURCE_NOT_FOUND, "Reconcile", message));
            }
            plan.children = kept;
            return Ok(plan);
        };
        let mut synced = Vec::new();
        let mut taken = Vec::new();
        let mut written = Vec::new();
        let mut children = Vec::new();
        for ns in targets(m, &world.namespaces) {
            let existing = world.named.get(&ns).map(Arc::as_ref);
            if existing.is_some_and(|c| !controlled_by(c, &uid)) {
                // Someone else's ConfigMap of that name: never taken over.
                taken.push(ns);
                continue;
            }
            let child = Child::apply(&build_copy(m, source, &ns), existing);
            if child.is_needed() {
                written.push(ns.clone());
            }
            children.push(child);
            synced.push(ns);
        }
        let ready = if taken.is_empty() {
            Desired::yes(
                condition::READY,
                reason::SYNCED,
                format!("copied to {} namespaces", synced.len()),
            )
        } else {
            Desired::no(
                condition::READY,
                reason::CONFLICT,
                format!(
                    "ConfigMap {} exists in {} and is not managed by this mirror",
                    source.name_any(),
                    taken.join(", ")
                ),
            )
        };
        let mut plan = Plan::status(status(synced, ready.clone()), hourly);
        if !taken.is_empty() && flips(&live, reason::CONFLICT) {
            plan = plan.event(Event::warning(
                reason::CONFLICT,
                "Reconcile",
                ready.message.clone(),
            ));
        }
        if !written.is_empty() {
            plan = plan.event(Event::normal(
                reason::COPIED,
                "Apply",
                format!("Copied ConfigMap {} to {}", source_key(m), written.join(", ")),
            ));
        }
        plan.children = children;
        Ok(plan)
    }

    fn cleans_up(&self) -> bool {
        true
    }

    fn cleanup(&self, m: &ConfigMirror, world: &World, _now: Timestamp) -> Cleanup<ConfigMirrorStatus> {
        if world.copies.is_empty() {
            return Cleanup::done().event(Event::normal(
                reason::REMOVED,
                "Cleanup",
                format!("Removed every copy of ConfigMap {}", source_key(m)),
            ));
        }
        world.copies.iter().fold(Cleanup::pending(), |c, copy| {
            c.delete(Deletion::of(copy.as_ref()))
        })
    }
}

/// The namespaces `m` copies into, sorted: selected, not the source's, not terminating.
pub fn targets(m: &ConfigMirror, namespaces: &[Arc<Namespace>]) -> Vec<String> {
    let mut out: Vec<String> = namespaces
        .iter()
        .filter(|n| n.metadata.deletion_timestamp.is_none())
        .filter(|n| select::matches(&m.spec.namespace_selector, n.labels()))
        .map(|n| n.name_any())
        .filter(|n| *n != m.spec.source.namespace)
        .collect();
    out.sort();
    out
}

/// Whether the Ready condition is about to change to `reason` (one Event per change).
fn flips(live: &ConfigMirrorStatus, reason: &str) -> bool {
    conditions::find(&live.conditions, condition::READY).is_none_or(|c| c.reason != reason)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
    use opkit_api::config_mirror::{ConfigMirrorSpec, SourceRef};

    fn mirror(selector: serde_json::Value) -> ConfigMirror {
        let mut m = ConfigMirror::new(
            "shared",
            ConfigMirrorSpec {
                source: SourceRef {
                    namespace: "src".into(),
                    name: "settings".into(),
                },
                namespace_selector: serde_json::from_value::<LabelSelector>(selector).unwrap(),
            },
        );
        m.metadata.uid = Some("m-uid".into());
        m.metadata.generation = Some(1);
        m
    }

    fn ns(name: &str, labels: &[(&str, &str)]) -> Namespace {
        let mut n = Namespace::default();
        n.metadata.name = Some(name.into());
        n.metadata.labels = Some(
            labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        );
        n
    }

    fn cm(ns: &str, name: &str, data: &str) -> ConfigMap {
        ConfigMap {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some(ns.into()),
                ..Default::default()
            },
            data: Some(BTreeMap::from([("k".to_string(), data.to_string())])),
            ..Default::default()
        }
    }

    fn now() -> Timestamp {
        Timestamp::from_second(1_000).unwrap()
    }

    /// The caches as the controller's watches would fill them, for `observe`.
    fn caches(namespaces: Vec<Namespace>, configmaps: Vec<ConfigMap>) -> Caches {
        Caches {
            namespaces: Cache::from_objects(&Watch::all(), namespaces),
            configmaps: Cache::from_objects(
                &Watch::all().index(BY_MIRROR, |c: &ConfigMap| c.labels().get(MIRROR_LABEL).cloned()),
                configmaps,
            ),
        }
    }

    async fn world(m: &ConfigMirror, c: &Caches) -> World {
        // observe reads only the caches; a client that was never connected proves it.
        let client = Client::try_from(kube::Config::new("http://127.0.0.1:1".parse().unwrap())).unwrap();
        ConfigMirrorController.observe(m, c, &client).await.unwrap()
    }

    #[tokio::test]
    async fn copies_go_to_selected_namespaces_only_never_the_sources_nor_a_terminating_one() {
        let m = mirror(serde_json::json!({"matchLabels": {"mirror": "yes"}}));
        let mut gone = ns("gone", &[("mirror", "yes")]);
        gone.metadata.deletion_timestamp = Some(Time(now()));
        let c = caches(
            vec![
                ns("a", &[("mirror", "yes")]),
                ns("b", &[("mirror", "no")]),
                ns("src", &[("mirror", "yes")]),
                gone,
            ],
            vec![cm("src", "settings", "v1")],
        );
        let w = world(&m, &c).await;
        let p = ConfigMirrorController.plan(&m, &w, now()).unwrap();
        let names: Vec<String> = p.children.iter().map(|c| c.name().to_string()).collect();
        assert_eq!(names, ["settings"]);
        let s = p.status.unwrap();
        assert_eq!(s.namespaces, ["a"]);
        assert_eq!(s.synced_count, 1);
        assert_eq!(
            conditions::find(&s.conditions, condition::READY).unwrap().reason,
            reason::SYNCED
        );
        assert!(
            p.events[0].note.contains("Copied ConfigMap src/settings to a"),
            "{:?}",
            p.events
        );
    }

    #[tokio::test]
    async fn an_up_to_date_copy_is_not_written_and_an_edited_one_is() {
        let m = mirror(serde_json::json!({}));
        let source = cm("src", "settings", "v1");
        let copy = build_copy(&m, &source, "a");
        let mut edited = build_copy(&m, &source, "b");
        edited.data = Some(BTreeMap::from([("k".to_string(), "by hand".to_string())]));
        let c = caches(
            vec![ns("a", &[]), ns("b", &[]), ns("src", &[])],
            vec![source, copy, edited],
        );
        let w = world(&m, &c).await;
        assert_eq!(w.copies.len(), 2);
        let p = ConfigMirrorController.plan(&m, &w, now()).unwrap();
        let needed: Vec<bool> = p.children.iter().map(Child::is_needed).collect();
        assert_eq!(needed, [false, true], "a is current, b was edited");
        assert!(p.events[0].note.ends_with("to b"), "{:?}", p.events);
    }

    #[tokio::test]
    async fn a_configmap_someone_else_made_is_never_taken_over() {
        let m = mirror(serde_json::json!({}));
        let c = caches(
            vec![ns("a", &[]), ns("mine", &[]), ns("src", &[])],
            vec![cm("src", "settings", "v1"), cm("mine", "settings", "private")],
        );
        let p = ConfigMirrorController
            .plan(&m, &world(&m, &c).await, now())
            .unwrap();
        assert_eq!(p.children.len(), 1);
        let s = p.status.unwrap();
        assert_eq!(s.namespaces, ["a"]);
        let ready = conditions::find(&s.conditions, condition::READY).unwrap();
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_str()),
            ("False", reason::CONFLICT)
        );
        assert!(ready.message.contains("exists in mine"), "{}", ready.message);
        assert!(p.events.iter().any(|e| e.reason == reason::CONFLICT));
    }

    #[tokio::test]
    async fn without_a_source_copies_are_kept_and_the_mirror_says_why() {
        let m = mirror(serde_json::json!({}));
        let copy = build_copy(&m, &cm("src", "settings", "v1"), "a");
        let c = caches(vec![ns("a", &[]), ns("src", &[])], vec![copy]);
        let p = ConfigMirrorController
            .plan(&m, &world(&m, &c).await, now())
            .unwrap();
        assert_eq!(p.children.len(), 1, "kept, so not pruned");
        assert!(!p.children[0].is_needed());
        let ready = conditions::find(&p.status.unwrap().conditions, condition::READY)
            .cloned()
            .unwrap();
        assert_eq!(ready.reason, reason::SOURCE_NOT_FOUND);
        assert!(ready.message.contains("src/settings does not exist"));
    }

    #[tokio::test]
    async fn cleanup_deletes_every_copy_and_is_done_when_none_is_left() {
        let m = mirror(serde_json::json!({}));
        let source = cm("src", "settings", "v1");
        let copies = vec![build_copy(&m, &source, "a"), build_copy(&m, &source, "b")];
        let c = caches(vec![ns("a", &[]), ns("b", &[])], copies);
        let pending = ConfigMirrorController.cleanup(&m, &world(&m, &c).await, now());
        assert!(!pending.done);
        let targets: Vec<String> = pending.deletes.iter().map(Deletion::describe).collect();
        assert_eq!(targets.len(), 2);
        assert!(
            targets.contains(&"ConfigMap a/settings".to_string()),
            "{targets:?}"
        );
        let c = caches(vec![ns("a", &[]), ns("b", &[])], vec![]);
        let done = ConfigMirrorController.cleanup(&m, &world(&m, &c).await, now());
        assert!(done.done && done.deletes.is_empty());
    }

    #[test]
    fn an_invalid_selector_is_reported_not_retried() {
        let m = mirror(serde_json::json!({"matchExpressions": [{"key": "env", "operator": "In"}]}));
        let err = ConfigMirrorController
            .plan(&m, &World::default(), now())
            .unwrap_err();
        assert_eq!(
            (err.condition, err.reason),
            (condition::READY, reason::INVALID_SPEC)
        );
        assert!(
            err.message
                .contains("spec.namespaceSelector.matchExpressions[0].values"),
            "{}",
            err.message
        );
    }
}
