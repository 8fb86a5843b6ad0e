//! What a plan says: the children to apply or delete, the status to write, the Events to
//! publish, when to look again ([`Plan`]); what deleting an object still requires
//! ([`Cleanup`]); and why an object cannot be planned for ([`Invalid`]).
use std::fmt::Debug;
use std::time::Duration;

use kube::core::{ApiResource, DynamicObject};
use kube::runtime::events::EventType;
use kube::{Resource, ResourceExt};
use serde::Serialize;

use crate::kind::{KindScope, ResolvedKind};

/// The finalizer opkit keeps on the objects of a controller that [`crate::Reconciler::cleans_up`]:
/// `opkit.dev/<controller name>`. To delete such an object after its controller was removed
/// for good, remove the finalizer by hand:
/// `kubectl patch KIND NAME --type json -p '[{"op":"remove","path":"/metadata/finalizers"}]'`
/// (that removes every finalizer of the object; nothing cleans up after it then).
pub fn finalizer_name(controller: &str) -> String {
    format!("opkit.dev/{controller}")
}

/// What a controller still has to do before an object it cleans up may go.
#[derive(Debug)]
#[non_exhaustive]
pub struct Cleanup<S> {
    /// Objects to delete, in any namespace or none; one already gone counts as deleted.
    pub deletes: Vec<Deletion>,
    /// Changes to things outside the cluster, in order, after the deletions
    /// (e.g. dropping the database the object created).
    pub acts: Vec<Act>,
    /// Whether everything is gone: once the deletions and acts of this cleanup succeeded,
    /// opkit removes the finalizer and the object goes. While not done, opkit looks again
    /// when something watched changes, and after a growing delay.
    pub done: bool,
    /// A status to write while the cleanup goes on (e.g. what is left).
    pub status: Option<S>,
    /// Events to publish.
    pub events: Vec<Event>,
}

impl<S> Cleanup<S> {
    /// Nothing (left) to do.
    pub fn done() -> Self {
        Cleanup {
            deletes: Vec::new(),
            acts: Vec::new(),
            done: true,
            status: None,
            events: Vec::new(),
        }
    }

    /// Still waiting for something to go.
    pub fn pending() -> Self {
        Cleanup {
            done: false,
            ..Self::done()
        }
    }

    /// Adds an object to delete.
    pub fn delete(mut self, d: Deletion) -> Self {
        self.deletes.push(d);
        self
    }

    /// Adds a change to a thing outside the cluster ([`Act::new`]).
    pub fn act(mut self, act: Act) -> Self {
        self.acts.push(act);
        self
    }

    /// Adds an Event.
    pub fn event(mut self, event: Event) -> Self {
        self.events.push(event);
        self
    }
}

/// An object to delete: kind, namespace (none for a cluster-scoped kind), name, and the uid
/// that was seen, so that an object recreated under the same name is never deleted by mistake.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Deletion {
    pub(crate) resource: ApiResource,
    pub(crate) namespace: Option<String>,
    pub(crate) name: String,
    pub(crate) uid: Option<String>,
}

impl Deletion {
    /// Delete `obj` (as cached: its uid is a precondition).
    pub fn of<C: Resource<DynamicType = (), Scope: KindScope>>(obj: &C) -> Self {
        Deletion {
            resource: ApiResource::erase::<C>(&()),
            namespace: obj.namespace().filter(|_| <C::Scope as KindScope>::NAMESPACED),
            name: obj.name_any(),
            uid: obj.uid(),
        }
    }

    /// Delete `obj`, of a kind named at run time (as cached: its uid is a precondition).
    pub fn of_dynamic(kind: &ResolvedKind, obj: &DynamicObject) -> Self {
        Deletion {
            resource: kind.resource.clone(),
            namespace: obj.namespace().filter(|_| kind.namespaced),
            name: obj.name_any(),
            uid: obj.uid(),
        }
    }

    /// The kind, namespace and name, for messages.
    pub fn describe(&self) -> String {
        match &self.namespace {
            Some(ns) => format!("{} {ns}/{}", self.resource.kind, self.name),
            None => format!("{} {}", self.resource.kind, self.name),
        }
    }
}

/// Label naming the uid of the primary object that controls a child which cannot carry an
/// owner reference to it (a child in another namespace, or cluster-scoped under a namespaced
/// primary): [`crate::Watches::owns`] maps the child back to its owner and
/// [`crate::Watch::prune`] deletes it when the plan stops producing it. Kubernetes' garbage
/// collector does not know this label: a controller that uses it should also
/// [`crate::Reconciler::cleans_up`].
pub const OWNER_LABEL: &str = "opkit.dev/owner-uid";

/// What one reconcile should do, in the order opkit does it: children, deletions (asked for
/// and of orphans), status, Events, the next look.
#[derive(Debug)]
#[non_exhaustive]
pub struct Plan<S> {
    /// Objects to write; a no-op (nothing differs from the cache) costs no request.
    pub children: Vec<Child>,
    /// Objects to delete, each only if it is still the one observed (its uid).
    pub deletes: Vec<Deletion>,
    /// The status to apply; skipped when the live status already has every field of it.
    pub status: Option<S>,
    /// Events to publish after the writes succeeded; the plan emits them on changes only.
    pub events: Vec<Event>,
    /// When to reconcile again if nothing changes.
    pub requeue: Requeue,
    /// Delete the object itself once the rest is done (a finished run past its time to
    /// live); its owned children go with it through garbage collection.
    pub delete: bool,
    /// The status describes work still under way (see [`Plan::in_progress`]).
    pub in_progress: bool,
    /// Changes to things outside the cluster, carried out in order after the cluster writes
    /// and before the status ([`Plan::act`]).
    pub acts: Vec<Act>,
    /// Parts of the spec the plan had to leave out, reported beside the rest
    /// ([`Plan::degraded`]).
    pub degraded: Vec<Invalid>,
}

impl<S> Plan<S> {
    /// A plan that writes `status` (if it changed) and looks again as `requeue` says.
    pub fn status(status: S, requeue: Requeue) -> Self {
        Plan {
            children: Vec::new(),
            deletes: Vec::new(),
            status: Some(status),
            events: Vec::new(),
            requeue,
            delete: false,
            in_progress: false,
            acts: Vec::new(),
            degraded: Vec::new(),
        }
    }

    /// A plan that writes nothing and looks again as `requeue` says: a step with nothing to
    /// do, or a controller of objects it only reads. Spelled as a constructor so that plans
    /// keep compiling when `Plan` gains a field.
    pub fn nothing(requeue: Requeue) -> Self {
        Plan {
            children: Vec::new(),
            deletes: Vec::new(),
            status: None,
            events: Vec::new(),
            requeue,
            delete: false,
            in_progress: false,
            acts: Vec::new(),
            degraded: Vec::new(),
        }
    }

    /// A plan that deletes the object (its owned children follow) and writes nothing else.
    pub fn delete() -> Self {
        Plan {
            children: Vec::new(),
            deletes: Vec::new(),
            status: None,
            events: Vec::new(),
            requeue: Requeue::OnChange,
            delete: true,
            in_progress: false,
            acts: Vec::new(),
            degraded: Vec::new(),
        }
    }

    /// Adds a child to write.
    pub fn child(mut self, child: Child) -> Self {
        self.children.push(child);
        self
    }

    /// Adds an Event.
    pub fn event(mut self, event: Event) -> Self {
        self.events.push(event);
        self
    }

    /// Asks for a change to a thing outside the cluster ([`Act::new`]). opkit carries the
    /// acts out in order after the children and deletions, on a replica that may write, then
    /// reads each thing again: the next plan sees the result in the
    /// [`crate::OutsideCache`]. A failed act ends the reconcile as a [`Retry`] does (a
    /// condition, a Warning Event, another try after its delay); the status is not written.
    pub fn act(mut self, act: Act) -> Self {
        self.acts.push(act);
        self
    }

    /// Reports a part of the spec the plan cannot act on while the rest of the plan is still
    /// carried out: a scheduler with one bad schedule still trims its history and writes its
    /// status. `invalid`'s condition (and its `also`) is merged into the planned status (or,
    /// without one, the live status), with one Warning Event when it changes, as a whole
    /// [`Invalid`] would be. Its `retry` is not used: the plan's [`Requeue`] decides. Once the
    /// spec is fixed the plan stops reporting it, and the condition goes with the next status
    /// unless the plan sets it otherwise.
    pub fn degraded(mut self, invalid: Invalid) -> Self {
        self.degraded.push(invalid);
        self
    }

    /// Deletes `d` after the children are written: a child that must go now rather than when
    /// pruning finds it unproduced (a Pod to replace, a finished Job), or any object the
    /// controller may delete. `Deletion::of` takes the observed object, whose uid is a
    /// precondition: an object recreated under the same name meanwhile is left alone.
    pub fn delete_child(mut self, d: Deletion) -> Self {
        self.deletes.push(d);
        self
    }

    /// Marks the status as describing work still under way (a rollout, Pods starting) when
    /// `yes`. opkit then holds it back: it is written only once the object has been in
    /// progress for the controller's `progress-delay` ([`crate::Tuning::progress_delay`]), and
    /// again at most once per delay, within the controller's budget of such writes per
    /// rollout ([`crate::Tuning::progress_budget`]), while the first status without the mark (settled) is
    /// written at once. A change that settles quickly costs one status write instead of one
    /// per step, and a slow one is still shown. Until then the stored status keeps the last
    /// settled one, and `status.observedGeneration` below `metadata.generation` says the
    /// change is in progress (the convention `kubectl wait` and kstatus read). Children and
    /// Events are never held.
    pub fn in_progress(mut self, yes: bool) -> Self {
        self.in_progress = yes;
        self
    }
}

/// When a reconcile should run again by itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Requeue {
    /// Only when something watched changes.
    OnChange,
    /// After this long (also earlier, on a change). A wait is kept in about a hundred
    /// bytes per object: an hourly safety-net resync of every object costs
    /// next to nothing while it waits.
    After(Duration),
    /// As soon as the status this plan writes is stored: a step that must be recorded before
    /// the next one is taken (an intent written before the Pod it announces is created).
    /// opkit's own writes trigger no reconcile otherwise. A status already stored as planned
    /// is not written, so nothing brings the object back: the plan after a step must differ
    /// in its status (a phase, an intent), or ask for [`Requeue::After`].
    Again,
}

/// How a child is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Server-side apply with force: the controller owns every field it sets.
    Apply,
    /// Create only when absent, never take over an object of that name someone else made
    /// (client-go's sample-controller contract); a conflict fails the reconcile.
    Create,
    /// Server-side apply of a few fields of an object someone else owns (e.g. one annotation
    /// on a user's Deployment); never pruned.
    Fields,
    /// A JSON merge patch of an object someone else owns, seen in a cache: of that version
    /// only (its `resourceVersion`), so that one changed since is planned for again and one
    /// deleted since is not made again, as an apply would; never pruned.
    Merge,
}

/// An object the plan wants written.
#[derive(Clone, Debug)]
pub struct Child {
    pub(crate) resource: ApiResource,
    pub(crate) namespace: Option<String>,
    pub(crate) namespaced: bool,
    pub(crate) name: String,
    pub(crate) body: serde_json::Value,
    pub(crate) mode: Mode,
    pub(crate) needed: bool,
    /// Whether the plan saw it in a cache: a sharded controller's caches hold only its own
    /// children, so one absent there may still exist, made by someone else.
    pub(crate) cached: bool,
}

impl Child {
    fn new<C: Resource<DynamicType = (), Scope: KindScope> + Serialize>(
        mode: Mode,
        namespace: Option<String>,
        name: String,
        body: serde_json::Value,
        live: Option<&C>,
    ) -> Self {
        let kind = ResolvedKind::new(ApiResource::erase::<C>(&()), <C::Scope as KindScope>::NAMESPACED);
        Self::of_kind(&kind, mode, namespace, name, body, live)
    }

    fn of_kind(
        kind: &ResolvedKind,
        mode: Mode,
        namespace: Option<String>,
        name: String,
        body: serde_json::Value,
        live: Option<&impl Serialize>,
    ) -> Self {
        let needed = match live.map(serde_json::to_value) {
            Some(Ok(l)) => {
                !crate::diff::is_subset(&body, &l)
                    || (matches!(mode, Mode::Apply)
                        && crate::diff::reshaped(crate::diff::created_shape(&l), &body))
            }
            _ => true,
        };
        Child {
            resource: kind.resource.clone(),
            namespace,
            namespaced: kind.namespaced,
            name,
            body,
            mode,
            needed,
            cached: live.is_some(),
        }
    }

    /// [`Child::apply`] for a kind named at run time ([`crate::Watches::dynamic`]): `desired`
    /// needs `metadata.name` (and `metadata.namespace` outside the primary's); its `apiVersion`
    /// and `kind` are `kind`'s.
    pub fn apply_dynamic(
        kind: &ResolvedKind,
        mut desired: serde_json::Value,
        live: Option<&DynamicObject>,
    ) -> Self {
        let (namespace, name) = identity(kind, &mut desired);
        Self::of_kind(kind, Mode::Apply, namespace, name, desired, live)
    }

    /// [`Child::fields`] for a kind named at run time: only `fields` (with `metadata.name`,
    /// and `metadata.namespace` outside the primary's) of an object someone else owns.
    pub fn fields_dynamic(
        kind: &ResolvedKind,
        mut fields: serde_json::Value,
        live: Option<&DynamicObject>,
    ) -> Self {
        let (namespace, name) = identity(kind, &mut fields);
        Self::of_kind(kind, Mode::Fields, namespace, name, fields, live)
    }

    /// Changes `live`, an object someone else owns, by a JSON merge patch (`null` removes a
    /// key) of the version seen, never pruned: one that changed since fails the reconcile as
    /// stale (the next plan sees the newer version), one deleted since is left deleted.
    /// Unlike [`Child::fields_dynamic`], it takes no field ownership and can never create
    /// the object; what it set it must remove by name.
    pub fn merge_dynamic(kind: &ResolvedKind, live: &DynamicObject, mut patch: serde_json::Value) -> Self {
        let live_json = serde_json::to_value(live).unwrap_or_default();
        let needed = !merged(&patch, &live_json);
        if let Some(m) = patch.as_object_mut() {
            let meta = m.entry("metadata").or_insert_with(|| serde_json::json!({}));
            if meta.is_object() {
                meta["resourceVersion"] = live.resource_version().unwrap_or_default().into();
            }
        }
        Child {
            resource: kind.resource.clone(),
            namespace: live.namespace().filter(|_| kind.namespaced),
            namespaced: kind.namespaced,
            name: live.name_any(),
            body: patch,
            mode: Mode::Merge,
            needed,
            cached: true,
        }
    }

    /// Server-side apply `desired` unless `live` (the cached object) already has all of it.
    ///
    /// With `live` `None` the child is created with a POST, which costs the API server about
    /// half of an apply that creates, and applied only if it exists after all: pass the cached
    /// object whenever there is one. Such a child's fields belong to the controller's `Update`
    /// entry in `managedFields` until the plan sets other fields than it created
    /// ([`crate::diff::CREATED_SHAPE`]); from then on they are its `Apply` entry, as if applied
    /// from the start.
    pub fn apply<C: Resource<DynamicType = (), Scope: KindScope> + Serialize>(
        desired: &C,
        live: Option<&C>,
    ) -> Self {
        Self::typed(Mode::Apply, desired, live)
    }

    /// Create `desired` unless `live` shows it exists; never take over an object of that name
    /// someone else made (client-go's sample-controller contract): a conflict fails the
    /// reconcile.
    pub fn create<C: Resource<DynamicType = (), Scope: KindScope> + Serialize>(
        desired: &C,
        live: Option<&C>,
    ) -> Self {
        let mut c = Self::typed(Mode::Create, desired, live);
        c.needed = live.is_none();
        c
    }

    fn typed<C: Resource<DynamicType = (), Scope: KindScope> + Serialize>(
        mode: Mode,
        desired: &C,
        live: Option<&C>,
    ) -> Self {
        let body = serde_json::to_value(desired).unwrap_or_default();
        Self::new(mode, desired.namespace(), desired.name_any(), body, live)
    }

    /// Server-side apply only `fields` (a partial object with `spec`/`metadata` parts) of the
    /// object `name` of kind `C` (`namespace` is ignored for a cluster-scoped kind), e.g. one
    /// annotation on a user's Deployment; the rest stays the other owner's, and it is never
    /// pruned.
    pub fn fields<C: Resource<DynamicType = (), Scope: KindScope> + Serialize>(
        namespace: &str,
        name: &str,
        mut fields: serde_json::Value,
        live: Option<&C>,
    ) -> Self {
        if let Some(m) = fields.as_object_mut() {
            m.insert("apiVersion".into(), C::api_version(&()).into());
            m.insert("kind".into(), C::kind(&()).into());
            let meta = m.entry("metadata").or_insert_with(|| serde_json::json!({}));
            meta["name"] = name.into();
        }
        Self::new(Mode::Fields, Some(namespace.into()), name.into(), fields, live)
    }

    /// Overrides the comparison with the cache, for a child whose cached copy is trimmed of
    /// fields the desired object sets (the plan then compares what it knows is kept).
    pub fn needed(mut self, needed: bool) -> Self {
        self.needed = needed;
        self
    }

    /// Whether writing this child would change anything (false: opkit skips it).
    pub fn is_needed(&self) -> bool {
        self.needed
    }

    /// What would be written (for a plan's unit test).
    pub fn body(&self) -> &serde_json::Value {
        &self.body
    }

    /// The child's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The kind and name, for messages.
    pub fn describe(&self) -> String {
        format!("{} {}", self.resource.kind, self.name)
    }

    /// Where the child lives: its own namespace, else `default` (the primary's) for a
    /// namespaced kind; none for a cluster-scoped kind.
    pub(crate) fn namespace<'a>(&'a self, default: Option<&'a str>) -> Option<&'a str> {
        if !self.namespaced {
            return None;
        }
        self.namespace.as_deref().or(default)
    }
}

/// Whether the JSON merge patch `patch` would leave `live` as it is.
fn merged(patch: &serde_json::Value, live: &serde_json::Value) -> bool {
    match patch {
        serde_json::Value::Object(p) => p.iter().all(|(k, v)| match (v, live.get(k)) {
            (serde_json::Value::Null, l) => l.is_none_or(serde_json::Value::is_null),
            // Merged into nothing: no change as long as it only removes.
            (serde_json::Value::Object(_), None) => merged(v, &serde_json::Value::Null),
            (v, Some(l)) => merged(v, l),
            (_, None) => false,
        }),
        v => v == live,
    }
}

/// Sets `body`'s `apiVersion` and `kind` to `kind`'s; its namespace and name.
fn identity(kind: &ResolvedKind, body: &mut serde_json::Value) -> (Option<String>, String) {
    if let Some(m) = body.as_object_mut() {
        m.insert("apiVersion".into(), kind.resource.api_version.clone().into());
        m.insert("kind".into(), kind.resource.kind.clone().into());
    }
    let meta = &body["metadata"];
    let text = |v: &serde_json::Value| v.as_str().map(String::from);
    (text(&meta["namespace"]), text(&meta["name"]).unwrap_or_default())
}

/// An Event about the primary object, shown by `kubectl describe`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    /// Normal or Warning.
    pub type_: EventType,
    /// A CamelCase reason, e.g. `Created`.
    pub reason: &'static str,
    /// What the controller did or tried, e.g. `Reconcile`.
    pub action: &'static str,
    /// The message a person reads (cut to 1024 bytes, what the apiserver accepts).
    pub note: String,
}

impl Event {
    /// A Normal Event.
    pub fn normal(reason: &'static str, action: &'static str, note: impl Into<String>) -> Self {
        Event {
            type_: EventType::Normal,
            reason,
            action,
            note: fit_note(note.into()),
        }
    }

    /// A Warning Event.
    pub fn warning(reason: &'static str, action: &'static str, note: impl Into<String>) -> Self {
        Event {
            type_: EventType::Warning,
            reason,
            action,
            note: fit_note(note.into()),
        }
    }
}

/// The apiserver refuses an Event whose note is longer than this many bytes.
pub(crate) const MAX_NOTE: usize = 1024;

/// Cuts a note (a container's termination message, say) to what an Event may hold, on a
/// character boundary, marking the cut.
fn fit_note(mut note: String) -> String {
    const MARK: &str = "…";
    if note.len() <= MAX_NOTE {
        return note;
    }
    let mut end = MAX_NOTE - MARK.len();
    while !note.is_char_boundary(end) {
        end -= 1;
    }
    note.truncate(end);
    note.push_str(MARK);
    note
}

/// One change to a thing outside the cluster that a plan asks for: made with [`Act::new`]
/// from a key and an action of an [`crate::Outside`] source, carried out by opkit.
pub struct Act {
    pub(crate) source: std::any::TypeId,
    pub(crate) name: &'static str,
    /// The key, as `Debug` shows it.
    pub(crate) key: String,
    /// The key and the action.
    pub(crate) payload: Box<dyn std::any::Any + Send + Sync>,
}

impl Act {
    /// The action's name and the key, for messages: `create_database "app"`. Never the
    /// action itself, which may hold a secret.
    pub fn describe(&self) -> String {
        format!("{} {}", self.name, self.key)
    }
}

impl Debug for Act {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

/// A spec the controller cannot act on. opkit records it as this condition in
/// `status.conditions` (with `observedGeneration`), publishes one Warning Event when the
/// condition changes, and waits for the next change of the object: no retries, no hot loop.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Invalid {
    /// Condition type, e.g. `Degraded` or `Scheduled`.
    pub condition: &'static str,
    /// The condition's status: `true` for a `Degraded`-style type, `false` for `Ready`-style.
    pub status: bool,
    /// Condition reason and Event reason, e.g. `InvalidSpec`.
    pub reason: &'static str,
    /// What is wrong, naming the field.
    pub message: String,
    /// Other conditions the plan could still decide (e.g. whether a target exists), written
    /// in the same status update.
    pub also: Vec<crate::conditions::Desired<'static>>,
    /// Made from a [`Retry`]: reconcile again after this long.
    pub retry: Option<Duration>,
}

impl Invalid {
    /// An invalid spec reported as condition `condition` at `status`, with `reason`.
    pub fn new(
        condition: &'static str,
        status: bool,
        reason: &'static str,
        message: impl Into<String>,
    ) -> Self {
        Invalid {
            condition,
            status,
            reason,
            message: message.into(),
            also: Vec::new(),
            retry: None,
        }
    }

    /// Adds another condition to write with it.
    pub fn with(mut self, condition: crate::conditions::Desired<'static>) -> Self {
        self.also.push(condition);
        self
    }
}

/// A failure that passes: an outside service that is down or limits its rate, something the
/// object needs that is not there yet. opkit records it as this condition, as it does an
/// [`Invalid`] (one Warning Event when the condition changes), and reconciles the object again
/// after `after`: not on the backoff's schedule, since whoever failed knows best when trying
/// again is worth it (a `Retry-After`, a rate limit's window). A change of the object still
/// reconciles it at once.
///
/// `observe` returns it as its error (`Err(retry.into())`, a `kube::Error` that opkit
/// recognises), a plan as its [`Invalid`] (`Err(retry.into())`). Reconciles that end in one
/// are counted with the result `retry`, apart from failures.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Retry {
    /// How long to wait before reconciling again (at least a second).
    pub after: Duration,
    /// Condition type, e.g. `Ready`.
    pub condition: &'static str,
    /// The condition's status: `false` for a `Ready`-style type, `true` for `Degraded`-style.
    pub status: bool,
    /// Condition reason and Event reason, e.g. `ServerUnavailable`.
    pub reason: &'static str,
    /// What failed, as a person reads it in `kubectl describe`. Never a secret.
    pub message: String,
}

impl Retry {
    /// A failure reported as condition `condition` at `status`, with `reason`, tried again
    /// after `after`.
    pub fn new(
        after: Duration,
        condition: &'static str,
        status: bool,
        reason: &'static str,
        message: impl Into<String>,
    ) -> Self {
        Retry {
            after,
            condition,
            status,
            reason,
            message: message.into(),
        }
    }

    /// The `Retry` an `observe` returned, if `err` is one.
    pub(crate) fn of(err: &kube::Error) -> Option<&Retry> {
        match err {
            kube::Error::Service(e) => e.downcast_ref::<Retry>(),
            _ => None,
        }
    }
}

impl std::fmt::Display for Retry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (trying again in {:?})", self.message, self.after)
    }
}

impl std::error::Error for Retry {}

impl From<Retry> for kube::Error {
    fn from(r: Retry) -> Self {
        kube::Error::Service(Box::new(r))
    }
}

impl From<Retry> for Invalid {
    fn from(r: Retry) -> Self {
        Invalid {
            condition: r.condition,
            status: r.status,
            reason: r.reason,
            message: r.message,
            also: Vec::new(),
            retry: Some(r.after),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_of_a_kind_named_at_run_time_is_compared_with_what_was_seen() {
        let cm = ResolvedKind::new(
            ApiResource::erase::<k8s_openapi::api::core::v1::ConfigMap>(&()),
            true,
        );
        let live: DynamicObject = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "a", "namespace": "ns", "resourceVersion": "7", "labels": {"team": "x"}},
            "data": {"k": "v"},
        }))
        .expect("object");
        let desired =
            serde_json::json!({"metadata": {"name": "a", "namespace": "ns", "labels": {"team": "x"}}});
        let apply = Child::apply_dynamic(&cm, desired.clone(), Some(&live));
        assert!(!apply.is_needed(), "the cached object has all of it");
        assert_eq!(apply.body()["kind"], "ConfigMap");
        assert_eq!((apply.namespace(None), apply.name()), (Some("ns"), "a"));
        assert!(
            Child::fields_dynamic(
                &cm,
                serde_json::json!({"metadata": {"name": "b", "namespace": "ns"}}),
                None
            )
            .is_needed()
        );
        // A merge patch: a no-op when every key already has its value (or is absent for null).
        let same = Child::merge_dynamic(
            &cm,
            &live,
            serde_json::json!({"metadata": {"labels": {"team": "x", "gone": null}, "annotations": {"a": null}}}),
        );
        assert!(!same.is_needed());
        let change = Child::merge_dynamic(
            &cm,
            &live,
            serde_json::json!({"metadata": {"labels": {"team": null}}}),
        );
        assert!(change.is_needed());
        assert_eq!(
            change.body()["metadata"]["resourceVersion"],
            "7",
            "of the version seen only"
        );
        assert_eq!((change.namespace(None), change.name()), (Some("ns"), "a"));
        let d = Deletion::of_dynamic(&cm, &live);
        assert_eq!(d.describe(), "ConfigMap ns/a");
    }

    #[test]
    fn a_retry_survives_the_trip_through_a_kube_error_and_becomes_an_invalid_with_a_delay() {
        let r = Retry::new(
            Duration::from_secs(30),
            "Ready",
            false,
            "RateLimited",
            "the API said: slow down",
        );
        let e: kube::Error = r.clone().into();
        assert_eq!(Retry::of(&e), Some(&r));
        assert!(e.to_string().contains("slow down"), "{e}");
        assert_eq!(Retry::of(&kube::Error::LinesCodecMaxLineLengthExceeded), None);
        let i: Invalid = r.into();
        assert_eq!(i.retry, Some(Duration::from_secs(30)));
        assert_eq!(i.reason, "RateLimited");
    }

    #[test]
    fn event_notes_fit_what_the_apiserver_accepts() {
        assert_eq!(Event::normal("R", "A", "short").note, "short");
        let exact = "x".repeat(MAX_NOTE);
        assert_eq!(Event::normal("R", "A", exact.clone()).note, exact);
        // Multi-byte characters straddling the limit are not split.
        let long = "é".repeat(MAX_NOTE);
        let note = Event::warning("R", "A", long).note;
        assert!(note.len() <= MAX_NOTE, "{}", note.len());
        assert!(note.ends_with('…'));
        assert!(note.trim_end_matches('…').chars().all(|c| c == 'é'));
    }
}
