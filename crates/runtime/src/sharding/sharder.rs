//! The sharder: run by the leader while it leads, it keeps every object of one sharded
//! controller labelled with its owner (see the module documentation of [`super`]).
//!
//! It watches the objects' metadata only (name, labels, resourceVersion: a fraction of the
//! objects themselves) and the member Leases, and writes nothing but the two labels, each
//! write conditional on the resourceVersion it decided from.
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{FutureExt, StreamExt};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::core::PartialObjectMeta;
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};

use crate::kind::{Watchable, api};

use super::{
    GROUP_LABEL, Members, Move, Placed, Ring, adopt_annotation, decide, drain_label, member_of, ring,
    shard_label,
};

/// Label writes in flight at once.
const CONCURRENCY: usize = 32;

/// How long a member stays dead before its Lease is deleted: a restarted process is a new
/// member, so without this every restart would leave a Lease behind.
const FORGET_AFTER: Duration = Duration::from_secs(60);

/// One object, kept small: the leader holds one per object of the kind, so at 30000 objects
/// every field costs. Its namespace and name are in its key ([`ring::key`]).
struct Object {
    resource_version: Option<Box<str>>,
    /// Interned ([`intern`]): every object of one member shares its name.
    owner: Option<Arc<str>>,
    draining: bool,
    /// Listed when the sharder started, without an owner: its children (if any) were made
    /// by an operator that did not shard, or by an owner this sharder never saw.
    initial: bool,
}

impl Object {
    /// Whether children of another owner may exist: the object had an owner, was let go of
    /// (its drain label stays until it is assigned), or predates this sharder.
    fn had_owner(&self) -> bool {
        self.owner.is_some() || self.draining || self.initial
    }
}

/// What one pass decided, for logs and metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Moves {
    /// Objects labelled with an owner.
    pub assigned: usize,
    /// Objects whose owner was asked to let them go.
    pub drained: usize,
}

/// Keeps the objects of `controller` (kind `K`, in `namespaces`; `None`: all; those its
/// primary watch selects: `selectors` are its label and field selectors) placed on the live
/// members of `group`, whose Leases are in `leases`, until the future is dropped.
/// Moves, handover times and members are counted in `metrics`.
pub(crate) async fn run<K>(
    client: Client,
    leases: Api<Lease>,
    group: String,
    controller: &'static str,
    namespaces: Vec<Option<String>>,
    selectors: (Option<String>, Option<String>),
    metrics: crate::metrics::ControllerMetrics,
) where
    K: Watchable,
    PartialObjectMeta<K>: Watchable,
{
    // A cluster-scoped kind is watched once, whatever the namespaces (as `runtime::run` does).
    let namespaces = if crate::kind::namespaced::<K>() {
        namespaces
    } else {
        vec![None]
    };
    let apis: Vec<Api<PartialObjectMeta<K>>> = namespaces
        .iter()
        .map(|ns| api::<PartialObjectMeta<K>>(&client, ns.as_deref()))
        .collect();
    let mut st = State {
        listed: vec![false; apis.len()],
        scopes: namespaces.clone(),
        group: group.clone(),
        shard: shard_label(controller),
        drain: drain_label(controller),
        adopt: adopt_annotation(controller),
        ..State::default()
    };
    // The objects the controller watches, no more: its own label and field selectors.
    let mut cfg = watcher::Config::default();
    if let Some(l) = &selectors.0 {
        cfg = cfg.labels(l);
    }
    if let Some(f) = &selectors.1 {
        cfg = cfg.fields(f);
    }
    // Each event tagged with its stream, whose namespace a relist covers.
    let mut objects_events = futures::stream::select_all(
        apis.into_iter()
            .enumerate()
            .map(|(i, api)| watcher(api, cfg.clone()).map(move |ev| (i, ev)).boxed()),
    );
    let selector = format!("{GROUP_LABEL}={group}");
    let mut lease_events = watcher(leases.clone(), watcher::Config::default().labels(&selector)).boxed();
    let mut ring = Ring::default();
    // Label writes in flight: events keep being read while they run, and an object with a
    // write in flight is not decided on again until it is answered.
    let mut inflight: futures::stream::FuturesUnordered<
        futures::future::BoxFuture<'static, (String, Move, Option<bool>)>,
    > = futures::stream::FuturesUnordered::new();
    let mut pending: HashSet<String> = HashSet::new();
    // Objects that changed while a write of theirs was in flight: decided on once answered.
    let mut deferred: HashSet<String> = HashSet::new();
    let mut moved = (Moves::default(), Instant::now());
    // When each silent member's Lease was last tried to be taken.
    let mut fenced_at: HashMap<String, Instant> = HashMap::new();
    let mut pruned_at = Instant::now();
    // Objects whose label write failed for another reason than a change (a timeout, a 5xx, a
    // 403 or a policy's denial): decided on again from this time on, for no watch event will
    // come for them; each failure in a row doubles the wait.
    let mut retry: Vec<(Instant, String)> = Vec::new();
    let mut failures: HashMap<String, u32> = HashMap::new();
    // Reads of the Lease of a member named by an object's label but not seen by this
    // sharder's watch (see `admit`).
    let mut lookups: futures::stream::FuturesUnordered<futures::future::BoxFuture<'static, Lookup>> =
        futures::stream::FuturesUnordered::new();
    loop {
        let now = Instant::now();
        let synced = st.listed.iter().all(|l| *l) && st.leases_listed;
        let wake = if synced && !st.dirty.is_empty() && inflight.len() < CONCURRENCY {
            // Decisions waiting for a free slot.
            Duration::ZERO
        } else if st.members.expired(now).is_empty() {
            st.members
                .next_expiry(now)
                .into_iter()
                .chain(retry.iter().map(|(t, _)| *t))
                .min()
                .map_or(Duration::from_secs(60), |t| t.saturating_duration_since(now))
                .max(Duration::from_millis(100))
        } else {
            // A member to fence whose fencing failed: try again soon.
            Duration::from_secs(1)
        };
        let failed = tokio::select! {
            ev = objects_events.next() => match ev {
                Some((i, ev)) => st.on_object(i, ev, controller),
                None => return,
            },
            ev = lease_events.next() => match ev {
                Some(ev) => st.on_lease(ev, controller),
                None => return,
            },
            Some((key, m, ok)) = inflight.next(), if !inflight.is_empty() => {
                answered(&mut st, (&mut pending, &mut deferred, &mut retry, &mut failures), key, m, ok, &metrics, &mut moved.0);
                false
            }
            Some(found) = lookups.next(), if !lookups.is_empty() => {
                st.looked_up(found, &mut retry, controller);
                false
            }
            _ = tokio::time::sleep(wake) => false,
        };
        if failed {
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        }
        // Everything already received goes in before deciding: a member must not look dead
        // for want of reading its renewals.
        loop {
            if let Some(Some(ev)) = lease_events.next().now_or_never() {
                st.on_lease(ev, controller);
            } else if let Some(Some((i, ev))) = objects_events.next().now_or_never() {
                st.on_object(i, ev, controller);
            } else if let Some(Some(found)) = lookups.next().now_or_never() {
                st.looked_up(found, &mut retry, controller);
            } else if let Some(Some((key, m, ok))) = inflight.next().now_or_never() {
                answered(
                    &mut st,
                    (&mut pending, &mut deferred, &mut retry, &mut failures),
                    key,
                    m,
                    ok,
                    &metrics,
                    &mut moved.0,
                );
            } else {
                break;
            }
        }
        if moved.0 != Moves::default() && moved.1.elapsed() >= Duration::from_secs(1) {
            tracing::info!(
                controller,
                assigned = moved.0.assigned,
                drained = moved.0.drained,
                "sharder: objects moved"
            );
            moved = (Moves::default(), Instant::now());
        }
        if !synced {
            continue;
        }
        let now = Instant::now();
        // A member whose Lease stood still for its duration is taken off the ring only once
        // its Lease is taken, conditional on the version seen: had it renewed since (this
        // sharder missed it), the write fails and it stays. Once taken, it cannot renew,
        // and its gate closed a renew deadline after its last renewal, which this version
        // records: no write of its can follow the objects' reassignment.
        for m in st.members.expired(now) {
            if fenced_at
                .get(&m)
                .is_some_and(|t| now.saturating_duration_since(*t) < Duration::from_secs(1))
            {
                continue;
            }
            fenced_at.insert(m.clone(), now);
            let Some(lease) = st.leases.get(&m).cloned() else {
                continue;
            };
            let mut taken = lease.clone();
            if let Some(spec) = taken.spec.as_mut() {
                spec.holder_identity = None;
            }
            match leases
                .replace(&lease.name_any(), &PostParams::default(), &taken)
                .await
            {
                Ok(l) => {
                    tracing::info!(controller, member = %m, "sharder: took the Lease of a member that stopped renewing");
                    st.on_lease(Ok(watcher::Event::Apply(l)), controller);
                    // Cleared by this sharder, not by hand: the member's gate has closed.
                    st.members.taken(&m);
                }
                Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => {}
                Err(e) => {
                    tracing::warn!(controller, member = %m, error = %e, "sharder: taking a silent member's Lease failed")
                }
            }
        }
        st.members.settle(now);
        let live = st.members.held();
        if live.as_slice() != ring.members() {
            tracing::info!(controller, members = ?live, "sharder: members changed");
            metrics.shard_members(live.len());
            ring = Ring::new(&live);
            st.dirty.extend(st.objects.keys().cloned());
        }
        for m in st.members.gone_for(FORGET_AFTER, now) {
            // Every object of its was moved long ago; the Lease only takes room. Conditional
            // on the version judged, so a member that came back keeps its Lease.
            if let Some(lease) = st.leases.get(&m) {
                let dp = kube::api::DeleteParams {
                    preconditions: Some(kube::api::Preconditions {
                        resource_version: lease.resource_version(),
                        uid: None,
                    }),
                    ..Default::default()
                };
                let gone = match leases.delete(&lease.name_any(), &dp).await {
                    Ok(_) => {
                        tracing::info!(controller, member = %m, "sharder: deleted the Lease of a member long gone");
                        true
                    }
                    Err(kube::Error::Api(s)) if s.code == 404 => true,
                    // Changed since (409: the member came back; its event is on the way), or
                    // failed: it stays known, with its Lease, until its next event decides.
                    Err(kube::Error::Api(s)) if s.code == 409 => false,
                    Err(e) => {
                        tracing::warn!(controller, member = %m, error = %e, "sharder: deleting a gone member's Lease failed");
                        false
                    }
                };
                if !gone {
                    let spec = lease.spec.clone().unwrap_or_default();
                    st.members.observe(&m, spec, super::rejoin(lease), now);
                    continue;
                }
            }
            st.forget(&m);
        }
        if now.saturating_duration_since(pruned_at) >= FORGET_AFTER {
            pruned_at = now;
            st.prune();
            fenced_at.retain(|m, _| st.members.knows(m));
            failures.retain(|k, _| st.objects.contains_key(k));
        }
        let due = retry.iter().filter(|(t, _)| *t <= now).count();
        if due > 0 {
            retry.sort();
            st.dirty.extend(retry.drain(..due).map(|(_, k)| k));
        }
        // Decide on what changed, as far as there are free slots; the rest stays dirty.
        if inflight.len() >= CONCURRENCY {
            continue;
        }
        let keys: Vec<String> = st.dirty.iter().take(4 * CONCURRENCY).cloned().collect();
        for key in keys {
            if pending.contains(&key) {
                st.dirty.remove(&key);
                deferred.insert(key);
                continue;
            }
            if inflight.len() >= CONCURRENCY {
                break;
            }
            st.dirty.remove(&key);
            let Some(o) = st.objects.get(&key) else { continue };
            if let Some(owner) = st.unseen_owner(o) {
                // Labelled for a member this sharder has not seen: a placement webhook whose
                // watch was ahead of this one's. Moved now, the object could be taken from a
                // live member already working on it; its Lease decides first.
                let waiting = st.waiting.entry(owner.clone()).or_default();
                if waiting.is_empty() {
                    let (leases, m) = (leases.clone(), owner.clone());
                    let name = format!("{group}-member-{owner}");
                    let seen = st.lease_events.get(&*owner).copied().unwrap_or(0);
                    lookups.push(async move { (m, seen, leases.get_opt(&name).await) }.boxed());
                }
                waiting.insert(key);
                continue;
            }
            let placed = Placed {
                key: &key,
                owner: o.owner.as_deref(),
                draining: o.draining,
            };
            let Some(m) = decide(&placed, &ring, |m| st.members.is_held(m)) else {
                continue;
            };
            let (namespace, name) = ring::split_key(&key);
            let api = api::<PartialObjectMeta<K>>(&client, namespace);
            let body = st.patch(o, &m);
            let name = name.to_string();
            pending.insert(key.clone());
            inflight.push(async move {
                let r = api.patch(&name, &PatchParams::default(), &Patch::Merge(&body)).await;
                match r {
                    Ok(_) => (key, m, Some(true)),
                    // Changed since (409) or gone (404): its watch event decides again.
                    Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => (key, m, Some(false)),
                    Err(e) => {
                        tracing::warn!(controller, object = %key, error = %e, "sharder: labelling failed; trying again");
                        (key, m, None)
                    }
                }
            }
            .boxed());
        }
    }
}

/// A member named by a label, how many events of its Lease the watch had shown when the read
/// was sent, and its Lease as read (`None`: there is none).
type Lookup = (Arc<str>, u64, Result<Option<Lease>, kube::Error>);

/// Objects with a write in flight, those that changed meanwhile, those to retry, and the
/// failures in a row of each.
type Bookkeeping<'a> = (
    &'a mut HashSet<String>,
    &'a mut HashSet<String>,
    &'a mut Vec<(Instant, String)>,
    &'a mut HashMap<String, u32>,
);

/// The longest wait before a label write that keeps failing is tried again.
const RETRY_MAX: Duration = Duration::from_secs(300);

/// How long to wait after the `n`th failure in a row of an object's label write: 1 s, doubled
/// per failure up to [`RETRY_MAX`], so that a write refused for good (no RBAC for it, a
/// policy's denial) costs a few requests an hour, not one a second per object.
fn retry_after(n: u32) -> Duration {
    Duration::from_secs(1u64 << n.saturating_sub(1).min(16)).min(RETRY_MAX)
}

/// Takes a label write's answer in: `Some(true)` written, `Some(false)` refused for a change
/// (its event decides again), `None` failed otherwise (decided on again after
/// [`retry_after`]).
fn answered(
    st: &mut State,
    (pending, deferred, retry, failures): Bookkeeping<'_>,
    key: String,
    m: Move,
    ok: Option<bool>,
    metrics: &crate::metrics::ControllerMetrics,
    moved: &mut Moves,
) {
    pending.remove(&key);
    if deferred.remove(&key) {
        st.dirty.insert(key.clone());
    }
    match ok {
        Some(true) => {
            failures.remove(&key);
            st.written(&key, m, metrics, moved)
        }
        Some(false) => {
            failures.remove(&key);
        }
        None => {
            let n = failures.entry(key.clone()).or_default();
            *n = n.saturating_add(1);
            retry.push((Instant::now() + retry_after(*n), key));
        }
    }
}

/// What the sharder knows, from its two watches.
#[derive(Default)]
struct State {
    /// Whether each object stream (one per namespace in scope) has listed once, and the
    /// Lease watch.
    listed: Vec<bool>,
    leases_listed: bool,
    /// The namespace each object stream watches (`None`: all).
    scopes: Vec<Option<String>>,
    /// The keys listed so far by each stream relisting after a lost watch.
    relisting: HashMap<usize, HashSet<String>>,
    /// The members whose Leases were listed so far in a relist of the Lease watch.
    lease_relisting: Option<HashSet<String>>,
    shard: String,
    drain: String,
    adopt: String,
    objects: HashMap<String, Object>,
    /// Owner names, shared by the objects ([`intern`]).
    names: HashSet<Arc<str>>,
    /// Members named by labels whose Lease was read and found missing: they cannot write,
    /// and their objects move at once.
    absent: HashSet<Arc<str>>,
    /// Objects waiting for the Lease of the member they are labelled for to be read.
    waiting: HashMap<Arc<str>, HashSet<String>>,
    /// How many events of each member's Lease the watch has shown: a read sent before the
    /// last of them is older than what the watch said, and is not used.
    lease_events: HashMap<String, u64>,
    /// The group whose member Leases count (their label).
    group: String,
    members: Members,
    /// The last member Lease seen of each member: the version to fence or delete.
    leases: HashMap<String, Lease>,
    /// Since when an object has had to move away from a live owner (drain asked).
    moving_since: HashMap<String, Instant>,
    /// Objects to decide on again.
    dirty: HashSet<String>,
}

impl State {
    /// The merge patch that carries `m` out on `o`, conditional on the version decided from.
    fn patch(&self, o: &Object, m: &Move) -> serde_json::Value {
        let mut labels = serde_json::Map::new();
        let mut annotations = serde_json::Map::new();
        match m {
            Move::Assign { to } => {
                labels.insert(self.shard.clone(), to.clone().into());
                labels.insert(self.drain.clone(), serde_json::Value::Null);
                if o.had_owner() {
                    annotations.insert(self.adopt.clone(), "true".into());
                }
            }
            Move::Drain => {
                labels.insert(self.drain.clone(), "true".into());
            }
            Move::Undrain => {
                labels.insert(self.drain.clone(), serde_json::Value::Null);
            }
        }
        let mut metadata = serde_json::json!({"resourceVersion": o.resource_version, "labels": labels});
        if !annotations.is_empty() {
            metadata["annotations"] = annotations.into();
        }
        serde_json::json!({ "metadata": metadata })
    }

    /// Records a move written: until its watch event arrives, the object is as the write left
    /// it.
    fn written(&mut self, key: &str, m: Move, metrics: &crate::metrics::ControllerMetrics, done: &mut Moves) {
        let Some(o) = self.objects.get_mut(key) else {
            return;
        };
        match m {
            Move::Assign { to } => {
                // A handover: from the drain asked, or from the last renewal seen of the
                // owner that is gone.
                let since = self
                    .moving_since
                    .remove(key)
                    .or_else(|| o.owner.as_deref().and_then(|m| self.members.last_renewed(m)));
                if let Some(since) = since {
                    metrics.shard_handover(since.elapsed().as_secs_f64());
                }
                o.owner = Some(intern(&mut self.names, &to));
                o.draining = false;
                o.initial = false;
                done.assigned += 1;
                metrics.shard_moved("assigned", 1);
            }
            Move::Drain => {
                o.draining = true;
                done.drained += 1;
                metrics.shard_moved("drained", 1);
                self.moving_since.insert(key.to_string(), Instant::now());
            }
            Move::Undrain => {
                o.draining = false;
                self.moving_since.remove(key);
            }
        }
    }

    /// Takes in one event of the objects' watch; whether it was an error.
    fn on_object<K: Resource<DynamicType = ()>>(
        &mut self,
        stream: usize,
        ev: Result<watcher::Event<PartialObjectMeta<K>>, watcher::Error>,
        controller: &str,
    ) -> bool {
        match ev {
            Ok(watcher::Event::InitApply(o)) => {
                let key = ring::key(o.namespace().as_deref(), &o.name_any());
                if let Some(seen) = self.relisting.get_mut(&stream) {
                    seen.insert(key.clone());
                }
                let mut placed = object(&o, &self.shard, &self.drain, &mut self.names);
                // Only the first list: a relist after a lost watch sees objects this sharder
                // assigned itself.
                let first = !self.listed.get(stream).copied().unwrap_or(true);
                placed.initial =
                    (first || self.objects.get(&key).is_some_and(|p| p.initial)) && placed.owner.is_none();
                self.objects.insert(key.clone(), placed);
                self.dirty.insert(key);
            }
            Ok(watcher::Event::Apply(o)) => {
                let key = ring::key(o.namespace().as_deref(), &o.name_any());
                let mut placed = object(&o, &self.shard, &self.drain, &mut self.names);
                placed.initial = self.objects.get(&key).is_some_and(|p| p.initial) && placed.owner.is_none();
                self.objects.insert(key.clone(), placed);
                self.dirty.insert(key);
            }
            Ok(watcher::Event::Delete(o)) => {
                let key = ring::key(o.namespace().as_deref(), &o.name_any());
                self.objects.remove(&key);
                self.moving_since.remove(&key);
            }
            // A list, or a relist after a lost watch: what it does not list is gone (deleted
            // meanwhile, or listed by a first list that failed halfway).
            Ok(watcher::Event::Init) => {
                self.relisting.insert(stream, HashSet::new());
            }
            Ok(watcher::Event::InitDone) => {
                if let Some(l) = self.listed.get_mut(stream) {
                    *l = true;
                }
                if let Some(seen) = self.relisting.remove(&stream) {
                    let prefix = self
                        .scopes
                        .get(stream)
                        .cloned()
                        .flatten()
                        .map(|ns| format!("{ns}/"));
                    let covered = |k: &str| prefix.as_deref().is_none_or(|p| k.starts_with(p));
                    self.objects.retain(|k, _| seen.contains(k) || !covered(k));
                    let objects = &self.objects;
                    self.moving_since.retain(|k, _| objects.contains_key(k));
                }
            }
            Err(e) => {
                tracing::warn!(controller, error = %e, "sharder: watching the objects failed; retrying");
                return true;
            }
        }
        false
    }

    /// Forgets member `m`, whose Lease is gone (after its grace, if it was still held: see
    /// [`Members::remove`]); a read of that Lease sent before is stale.
    fn forget(&mut self, m: &str) {
        *self.lease_events.entry(m.to_string()).or_default() += 1;
        self.members.remove(m, Instant::now());
        self.leases.remove(m);
    }

    /// The member `o` is labelled for, if this sharder has neither seen its Lease nor found
    /// that there is none: it must read that Lease before deciding on `o`.
    fn unseen_owner(&self, o: &Object) -> Option<Arc<str>> {
        o.owner
            .as_ref()
            .filter(|m| !self.members.knows(m) && !self.absent.contains(*m))
            .cloned()
    }

    /// Forgets the names no object carries any more, and what was kept about them.
    fn prune(&mut self) {
        // An absent name is held by `names` and `absent`, plus each object labelled with it.
        self.absent.retain(|n| Arc::strong_count(n) > 2);
        self.names.retain(|n| Arc::strong_count(n) > 1);
        let (members, waiting, absent) = (&self.members, &self.waiting, &self.absent);
        self.lease_events.retain(|m, _| {
            members.knows(m) || waiting.contains_key(m.as_str()) || absent.contains(m.as_str())
        });
    }

    /// Takes in the Lease read of a member named by a label: its objects are decided on
    /// again, now that the member is known or known to be absent.
    fn looked_up(&mut self, (m, sent, read): Lookup, retry: &mut Vec<(Instant, String)>, controller: &str) {
        let keys = self.waiting.remove(&m).unwrap_or_default();
        if self.lease_events.get(&*m).copied().unwrap_or(0) != sent {
            // The watch showed the Lease since: it knows better than this read.
            self.dirty.extend(keys);
            return;
        }
        match read {
            Ok(Some(lease))
                if lease.labels().get(GROUP_LABEL) == Some(&self.group)
                    && member_of(&lease).as_deref() == Some(&*m) =>
            {
                // A member whose Lease event has not reached this sharder's watch yet.
                self.on_lease(Ok(watcher::Event::Apply(lease)), controller);
            }
            // No such Lease, or one of that name that is not a member's of this group (a
            // member always labels its Lease): nobody writes for this label.
            Ok(_) => {
                self.absent.insert(m);
            }
            Err(e) => {
                tracing::warn!(controller, member = %m, error = %e, "sharder: reading a member's Lease failed; trying again in 5 s");
                let at = Instant::now() + Duration::from_secs(5);
                retry.extend(keys.into_iter().map(|k| (at, k)));
                return;
            }
        }
        self.dirty.extend(keys);
    }

    /// Takes in one event of the member Leases' watch; whether it was an error.
    fn on_lease(&mut self, ev: Result<watcher::Event<Lease>, watcher::Error>, controller: &str) -> bool {
        match ev {
            Ok(watcher::Event::Apply(l) | watcher::Event::InitApply(l)) => {
                if let (Some(m), Some(spec)) = (member_of(&l), l.spec.clone()) {
                    *self.lease_events.entry(m.clone()).or_default() += 1;
                    if let Some(seen) = self.lease_relisting.as_mut() {
                        seen.insert(m.clone());
                    }
                    self.absent.remove(m.as_str());
                    self.members.observe(&m, spec, super::rejoin(&l), Instant::now());
                    self.leases.insert(m, l);
                }
            }
            Ok(watcher::Event::Delete(l)) => {
                if let Some(m) = member_of(&l) {
                    self.forget(&m);
                }
            }
            // A list, or a relist after a lost watch: the Leases it does not list are gone.
            Ok(watcher::Event::Init) => self.lease_relisting = Some(HashSet::new()),
            Ok(watcher::Event::InitDone) => {
                self.leases_listed = true;
                if let Some(seen) = self.lease_relisting.take() {
                    for m in self
                        .leases
                        .keys()
                        .filter(|m| !seen.contains(*m))
                        .cloned()
                        .collect::<Vec<_>>()
                    {
                        self.forget(&m);
                    }
                }
            }
            Err(e) => {
                tracing::warn!(controller, error = %e, "sharder: watching the member Leases failed; retrying");
                return true;
            }
        }
        false
    }
}

fn object<K: Resource<DynamicType = ()>>(
    o: &PartialObjectMeta<K>,
    shard: &str,
    drain: &str,
    names: &mut HashSet<Arc<str>>,
) -> Object {
    let labels: &BTreeMap<String, String> = o.labels();
    Object {
        resource_version: o.meta().resource_version.as_deref().map(Box::from),
        owner: labels
            .get(shard)
            .filter(|v| !v.is_empty())
            .map(|v| intern(names, v)),
        draining: labels.contains_key(drain),
        initial: false,
    }
}

/// The one shared copy of `name` (member names repeat over every object).
fn intern(names: &mut HashSet<Arc<str>>, name: &str) -> Arc<str> {
    if let Some(n) = names.get(name) {
        return n.clone();
    }
    let n: Arc<str> = Arc::from(name);
    names.insert(n.clone());
    n
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sharding::MEMBER_LABEL;
    use k8s_openapi::api::core::v1::ConfigMap;
    use watcher::Event;

    #[test]
    fn a_label_write_that_keeps_failing_waits_twice_as_long_each_time_and_starts_over_once_written() {
        assert_eq!(
            (1..=4).map(retry_after).collect::<Vec<_>>(),
            [1, 2, 4, 8].map(Duration::from_secs)
        );
        assert_eq!(retry_after(40), RETRY_MAX);
        let mut st = State::default();
        let (mut pending, mut deferred) = (HashSet::new(), HashSet::new());
        let (mut retry, mut failures) = (Vec::new(), HashMap::new());
        let metrics = crate::metrics::Metrics::default().for_controller("c");
        let mut moved = Moves::default();
        let started = Instant::now();
        for _ in 0..5 {
            let books = (&mut pending, &mut deferred, &mut retry, &mut failures);
            answered(
                &mut st,
                books,
                "ns/o".into(),
                Move::Drain,
                None,
                &metrics,
                &mut moved,
            );
        }
        // Each retry was scheduled further out than the one before.
        let waits: Vec<Duration> = retry.iter().map(|(t, _)| t.duration_since(started)).collect();
        assert!(waits.windows(2).all(|w| w[1] > w[0]), "{waits:?}");
        assert!(waits[4] >= Duration::from_secs(16), "{waits:?}");
        assert_eq!(failures["ns/o"], 5);
        let books = (&mut pending, &mut deferred, &mut retry, &mut failures);
        answered(
            &mut st,
            books,
            "ns/o".into(),
            Move::Drain,
            Some(false),
            &metrics,
            &mut moved,
        );
        assert!(failures.is_empty(), "an answer other than a failure starts over");
    }

    fn meta(ns: &str, name: &str) -> PartialObjectMeta<ConfigMap> {
        let mut o = PartialObjectMeta::<ConfigMap>::default();
        o.metadata.namespace = Some(ns.into());
        o.metadata.name = Some(name.into());
        o.metadata.resource_version = Some("1".into());
        o
    }

    fn list(st: &mut State, stream: usize, objects: &[(&str, &str)]) {
        st.on_object::<ConfigMap>(stream, Ok(Event::Init), "c");
        for (ns, name) in objects {
            st.on_object(stream, Ok(Event::InitApply(meta(ns, name))), "c");
        }
        st.on_object::<ConfigMap>(stream, Ok(Event::InitDone), "c");
    }

    fn keys(st: &State) -> Vec<&str> {
        let mut k: Vec<&str> = st.objects.keys().map(String::as_str).collect();
        k.sort_unstable();
        k
    }

    #[test]
    fn a_relist_forgets_what_was_deleted_while_the_watch_was_down_in_its_namespace_only() {
        let mut st = State {
            listed: vec![false; 2],
            scopes: vec![Some("a".into()), Some("b".into())],
            ..State::default()
        };
        list(&mut st, 0, &[("a", "x"), ("a", "y")]);
        list(&mut st, 1, &[("b", "z")]);
        assert_eq!(keys(&st), ["a/x", "a/y", "b/z"]);
        // Stream 0 lost its watch; y was deleted meanwhile. Stream 1's objects stay.
        list(&mut st, 0, &[("a", "x")]);
        assert_eq!(keys(&st), ["a/x", "b/z"]);
        // A stream over every namespace covers every key.
        let mut all = State {
            listed: vec![false],
            scopes: vec![None],
            ..State::default()
        };
        list(&mut all, 0, &[("a", "x"), ("b", "z")]);
        list(&mut all, 0, &[("b", "z")]);
        assert_eq!(keys(&all), ["b/z"]);
    }

    /// A held member Lease of group `g`, labelled as a member's or not.
    fn lease(m: &str, labelled: bool) -> Lease {
        let mut l = Lease::default();
        l.metadata.name = Some(format!("g-member-{m}"));
        let mut labels = BTreeMap::from([(MEMBER_LABEL.to_string(), m.to_string())]);
        if labelled {
            labels.insert(GROUP_LABEL.to_string(), "g".to_string());
        }
        l.metadata.labels = Some(labels);
        l.spec = Some(k8s_openapi::api::coordination::v1::LeaseSpec {
            holder_identity: Some(m.into()),
            lease_duration_seconds: Some(10),
            ..Default::default()
        });
        l
    }

    /// An object labelled for `owner`, taken in from the watch.
    fn labelled(st: &mut State, name: &str, owner: &str) -> String {
        let mut o = meta("ns", name);
        o.metadata.labels = Some([(st.shard.clone(), owner.to_string())].into());
        st.on_object(0, Ok(Event::Apply(o)), "c");
        ring::key(Some("ns"), name)
    }

    #[test]
    fn an_object_labelled_for_an_unseen_member_waits_for_its_lease_to_be_read() {
        let mut st = State {
            group: "g".into(),
            shard: shard_label("c"),
            listed: vec![true],
            leases_listed: true,
            ..State::default()
        };
        st.on_lease(Ok(Event::Apply(lease("m1", true))), "c");
        let owner_of = |st: &State, key: &str| st.unseen_owner(&st.objects[key]).map(|m| m.to_string());
        // What the sharder decides for `key`, labelled for `owner`, on the ring it now has.
        let decided = |st: &State, key: &str, owner: &str| {
            let placed = Placed {
                key,
                owner: Some(owner),
                draining: false,
            };
            decide(&placed, &Ring::new(st.members.held()), |m| st.members.is_held(m))
        };
        let mut retry = Vec::new();

        // No Lease: nobody can write for it, it moves at once.
        let k = labelled(&mut st, "a", "gone");
        assert_eq!(owner_of(&st, &k).as_deref(), Some("gone"));
        st.waiting.entry("gone".into()).or_default().insert(k.clone());
        st.looked_up(("gone".into(), 0, Ok(None)), &mut retry, "c");
        assert_eq!(owner_of(&st, &k), None);
        assert!(st.dirty.contains(&k));
        assert_eq!(decided(&st, &k, "gone"), Some(Move::Assign { to: "m1".into() }));

        // A held member Lease the watch has not shown yet: a live member, never overridden.
        let k = labelled(&mut st, "b", "m2");
        assert_eq!(owner_of(&st, &k).as_deref(), Some("m2"));
        st.looked_up(("m2".into(), 0, Ok(Some(lease("m2", true)))), &mut retry, "c");
        assert_eq!(owner_of(&st, &k), None);
        assert!(st.members.is_held("m2"));
        assert!(
            !matches!(decided(&st, &k, "m2"), Some(Move::Assign { .. })),
            "a live member's object was reassigned"
        );

        // A read sent before the watch showed the Lease go is older than the watch: unused.
        let k = labelled(&mut st, "c", "m3");
        st.on_lease(Ok(Event::Apply(lease("m3", true))), "c");
        st.on_lease(Ok(Event::Delete(lease("m3", true))), "c");
        // Deleted while held: known until its grace ends.
        assert!(st.members.is_held("m3"));
        st.members.settle(Instant::now() + Duration::from_secs(11));
        st.looked_up(("m3".into(), 1, Ok(Some(lease("m3", true)))), &mut retry, "c");
        assert!(!st.members.knows("m3") && !st.absent.contains("m3"));
        assert_eq!(owner_of(&st, &k).as_deref(), Some("m3"), "read again");

        // A failed read is tried again later; a Lease of that name not labelled as this
        // group's member is not a member's.
        let k = labelled(&mut st, "d", "m4");
        st.dirty.clear();
        st.waiting.entry("m4".into()).or_default().insert(k.clone());
        st.looked_up(
            (
                "m4".into(),
                0,
                Err(kube::Error::Api(
                    kube::core::Status::failure("etcdserver: request timed out", "InternalError")
                        .with_code(500)
                        .boxed(),
                )),
            ),
            &mut retry,
            "c",
        );
        assert!(retry.iter().any(|(_, r)| *r == k) && !st.dirty.contains(&k));
        st.looked_up(("m4".into(), 0, Ok(Some(lease("m4", false)))), &mut retry, "c");
        assert!(st.absent.contains("m4") && !st.members.knows("m4"));
    }

    #[test]
    fn a_relist_of_the_leases_forgets_members_whose_lease_went() {
        let lease = |m: &str| lease(m, true);
        let mut st = State::default();
        let relist = |st: &mut State, ms: &[&str]| {
            st.on_lease(Ok(Event::Init), "c");
            for m in ms {
                st.on_lease(Ok(Event::InitApply(lease(m))), "c");
            }
            st.on_lease(Ok(Event::InitDone), "c");
        };
        relist(&mut st, &["m1", "m2"]);
        assert_eq!(st.members.held(), ["m1", "m2"]);
        relist(&mut st, &["m2"]);
        // Gone while held: on the ring for its grace, then forgotten.
        assert_eq!(st.members.held(), ["m1", "m2"]);
        st.members.settle(Instant::now() + Duration::from_secs(11));
        assert_eq!(st.members.held(), ["m2"]);
        assert!(!st.leases.contains_key("m1"));
    }
}
