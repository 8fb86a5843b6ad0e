//! A fair line in front of the work queue.
//!
//! A work queue serves reconcile requests in the order they came: 10000 changes in one
//! namespace put a single change in another namespace behind all of them. Here requests wait
//! in one line per group (the namespace, unless the primary watch names another key with
//! [`crate::Watch::fair_by`]) and go on to the work queue in turns — one request from
//! each waiting group per round — a batch at a time and only while fewer than half a batch
//! handed over have not started. So a request of a quiet group waits behind at most that
//! batch and one request of each busy group, and a burst still gets a turn every round: it is
//! slowed by the other groups' share, never starved.
//!
//! While nothing waits here and the work queue is short, a request goes straight on: a
//! quiet operator pays nothing. What stays the work queue's: one reconcile per object at a time
//! (repeated requests merge), requeues and backoff after a reconcile (they do not come through
//! here) and the concurrency limit.
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::Stream;
use kube::Resource;
use kube::runtime::reflector::ObjectRef;
use serde::de::DeserializeOwned;

use crate::cache::Cache;
use tokio::sync::Notify;

use super::shared::queue_key;

/// A handed-over request that has not started after this long and is gone from the cache no
/// longer counts as waiting in the queue; one still there counts until [`LOST`].
pub(crate) const STALE: Duration = Duration::from_secs(5);

/// A handed-over request that has not started after this long no longer counts, gone or not: a
/// safety net, so that no request lost on the way can hold back the rest.
pub(crate) const LOST: Duration = Duration::from_secs(60);

/// How often a feed that waits for handed-over requests to start looks again.
pub(crate) const POLL: Duration = Duration::from_secs(1);

pub(crate) use crate::cache::GroupFn;

/// Requests handed over to the work queue that have not started: by queue key, since
/// when. Shared by the fair line and the resync, which each keep their own.
pub(crate) struct Handed<K: Resource<DynamicType = ()>>(HashMap<String, (ObjectRef<K>, Instant)>);

impl<K: Resource<DynamicType = ()>> Default for Handed<K> {
    fn default() -> Self {
        Handed(HashMap::new())
    }
}

impl<K: Resource<DynamicType = ()>> Handed<K> {
    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether fewer than half of `batch` wait: room for another batch.
    pub(crate) fn has_room(&self, batch: usize) -> bool {
        self.0.len() * 2 < batch
    }

    pub(crate) fn contains(&self, key: &str) -> bool {
        self.0.contains_key(key)
    }

    pub(crate) fn insert(&mut self, r: ObjectRef<K>, now: Instant) {
        self.0
            .insert(queue_key(r.namespace.as_deref(), &r.name), (r, now));
    }

    /// A reconcile of `key` started; whether it had been handed over from here.
    pub(crate) fn started(&mut self, key: &str) -> bool {
        self.0.remove(key).is_some()
    }

    /// Forgets what will not start: gone from the cache for [`STALE`], or waiting for [`LOST`].
    pub(crate) fn forget_lost(&mut self, now: Instant, cached: impl Fn(&ObjectRef<K>) -> bool) {
        self.0.retain(|_, (r, at)| {
            let waited = now.duration_since(*at);
            waited < STALE || (waited < LOST && cached(r))
        });
    }
}

/// One watch scope's fair line.
pub(crate) struct Admission<K: Resource<DynamicType = ()> + Clone + 'static> {
    inner: Mutex<Lines<K>>,
    wake: Notify,
    batch: usize,
    /// `false`: every request goes straight on, in arrival order (`fair-queue=false`).
    fair: bool,
    group: Option<GroupFn<K>>,
    primary: Cache<K>,
    /// Whether the primary kind is namespaced (a mapper may name a namespace for one that
    /// is not; the reconcile's key has none).
    namespaced: bool,
    /// Whether the primary watch is listing (from the start until its first list ends, and
    /// during a relist): the store then holds the listed objects only at the list's end, so
    /// a request for an object it does not have yet is neither dropped nor taken for lost.
    listing: std::sync::atomic::AtomicBool,
}

struct Lines<K: Resource<DynamicType = ()>> {
    lines: HashMap<String, VecDeque<ObjectRef<K>>>,
    /// The groups with waiting requests, next turn first.
    turns: VecDeque<String>,
    waiting: HashSet<ObjectRef<K>>,
    handed: Handed<K>,
}

impl<K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Send + Sync + 'static> Admission<K> {
    /// `concurrency` is the controller's limit of reconciles at once (0: none, and then
    /// nothing waits here: there is no queue to be fair in); `group` keys the lines (`None`:
    /// by namespace); `primary` is the primary cache, of a kind `namespaced` or not.
    pub(crate) fn new(
        concurrency: u16,
        fair: bool,
        group: Option<GroupFn<K>>,
        primary: Cache<K>,
        namespaced: bool,
    ) -> Arc<Self> {
        Arc::new(Admission {
            inner: Mutex::new(Lines {
                lines: HashMap::new(),
                turns: VecDeque::new(),
                waiting: HashSet::new(),
                handed: Handed::default(),
            }),
            wake: Notify::new(),
            batch: concurrency.into(),
            fair: fair && concurrency > 0,
            group,
            primary,
            namespaced,
            listing: std::sync::atomic::AtomicBool::new(true),
        })
    }

    /// Follows the primary watch's events: where its list stands.
    pub(crate) fn follow<E>(&self, ev: &Result<kube::runtime::watcher::Event<K>, E>) {
        use kube::runtime::watcher::Event;
        use std::sync::atomic::Ordering;
        match ev {
            Ok(Event::Init) => self.listing.store(true, Ordering::SeqCst),
            Ok(Event::InitDone) => {
                self.listing.store(false, Ordering::SeqCst);
                self.wake.notify_one();
            }
            _ => {}
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Lines<K>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A reconcile request for `r`: `Some` if it goes on to the work queue now, `None`
    /// if it waits here (or already does). A standby passes everything on: its reconciles
    /// wait for the Lease, not for a turn.
    pub(crate) fn admit(&self, mut r: ObjectRef<K>, leading: bool) -> Option<ObjectRef<K>> {
        if !self.fair || !leading {
            return Some(r);
        }
        if !self.namespaced {
            r.namespace = None;
        }
        // The author's key (of the cached object) is read before the lock: the other requests
        // do not wait on it. Without one, or for an object not cached, the namespace.
        let keyed = (self.group.as_ref()).and_then(|key| self.primary.get_ref(&r).map(|o| key(&o)));
        let mut inner = self.lock();
        if inner.waiting.contains(&r) {
            return None;
        }
        if inner.handed.contains(&queue_key(r.namespace.as_deref(), &r.name)) {
            // Already in the work queue: the two merge there.
            return Some(r);
        }
        if inner.turns.is_empty() && inner.handed.has_room(self.batch) {
            inner.handed.insert(r.clone(), Instant::now());
            return Some(r);
        }
        let group = keyed.unwrap_or_else(|| r.namespace.clone().unwrap_or_default());
        r.extra = Default::default();
        inner.waiting.insert(r.clone());
        match inner.lines.entry(group) {
            std::collections::hash_map::Entry::Occupied(line) => line.into_mut().push_back(r),
            std::collections::hash_map::Entry::Vacant(line) => {
                let group = line.key().clone();
                line.insert(VecDeque::from([r]));
                inner.turns.push_back(group);
            }
        }
        drop(inner);
        self.wake.notify_one();
        None
    }

    /// A reconcile of `key` takes a worker: if it was handed over from here, it no longer
    /// waits in the work queue.
    pub(crate) fn started(&self, key: &str) {
        let mut inner = self.lock();
        if inner.handed.started(key) && inner.handed.has_room(self.batch) && !inner.turns.is_empty() {
            drop(inner);
            self.wake.notify_one();
        }
    }

    /// How many requests wait here.
    #[cfg(test)]
    fn waiting(&self) -> usize {
        self.lock().waiting.len()
    }

    /// The next batch, one request per group in turn, if the work queue has room; else
    /// when to look again (`None`: when woken). A request for an object the primary cache
    /// does not have (deleted since) is dropped, as it would not start; not while the
    /// primary is listing, when the cache holds the listed objects only at the end. While
    /// this replica does not lead, every waiting request goes on: its reconciles wait for the
    /// Lease, not for a turn, and those handed on before will not start until it leads.
    fn take(&self, now: Instant, leading: bool) -> Result<Vec<ObjectRef<K>>, Option<Duration>> {
        let listing = self.listing.load(std::sync::atomic::Ordering::SeqCst);
        let cached = |r: &ObjectRef<K>| listing || self.primary.contains(r);
        let mut inner = self.lock();
        if !leading {
            inner.handed = Handed::default();
            inner.turns.clear();
            inner.waiting.clear();
            let all: Vec<ObjectRef<K>> = inner.lines.drain().flat_map(|(_, line)| line).collect();
            return if all.is_empty() { Err(None) } else { Ok(all) };
        }
        inner.handed.forget_lost(now, cached);
        if inner.turns.is_empty() {
            return Err(None);
        }
        if !inner.handed.has_room(self.batch) {
            return Err(Some(POLL));
        }
        let mut refs = Vec::with_capacity(self.batch);
        while refs.len() < self.batch {
            let Some(group) = inner.turns.pop_front() else {
                break;
            };
            let line = inner.lines.get_mut(&group).expect("a group in turn has a line");
            let r = line.pop_front().expect("a line in turn is not empty");
            if line.is_empty() {
                inner.lines.remove(&group);
            } else {
                inner.turns.push_back(group);
            }
            inner.waiting.remove(&r);
            if cached(&r) {
                inner.handed.insert(r.clone(), now);
                refs.push(r);
            }
        }
        match refs.is_empty() {
            true => Err(None),
            false => Ok(refs),
        }
    }

    /// The requests that waited here, for the work queue as their turns come.
    pub(crate) fn feed(
        self: Arc<Self>,
        leading: impl Fn() -> bool + Send + Sync + 'static,
    ) -> impl Stream<Item = ObjectRef<K>> + Send + 'static {
        super::shared::due(self, |a| &a.wake, move |a| a.take(Instant::now(), leading()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;

    fn cm(ns: &str, name: &str) -> ConfigMap {
        let mut c = ConfigMap::default();
        c.metadata.namespace = Some(ns.into());
        c.metadata.name = Some(name.into());
        c
    }

    /// An admission over a cache holding `objects`.
    fn admission(
        concurrency: u16,
        group: Option<GroupFn<ConfigMap>>,
        objects: &[ConfigMap],
    ) -> Arc<Admission<ConfigMap>> {
        let (store, mut writer) = Cache::empty(false);
        for o in objects {
            writer.apply(&kube::runtime::watcher::Event::Apply(o.clone()));
        }
        let a = Admission::new(concurrency, true, group, store, true);
        a.follow::<()>(&Ok(kube::runtime::watcher::Event::InitDone));
        a
    }

    fn names(refs: &[ObjectRef<ConfigMap>]) -> Vec<String> {
        refs.iter()
            .map(|r| format!("{}/{}", r.namespace.as_deref().unwrap_or(""), r.name))
            .collect()
    }

    #[test]
    fn a_quiet_operator_passes_requests_straight_on() {
        let a = admission(4, None, &[cm("a", "x"), cm("a", "y"), cm("a", "z")]);
        assert!(a.admit(ObjectRef::from_obj(&cm("a", "x")), true).is_some());
        assert!(
            a.admit(ObjectRef::from_obj(&cm("a", "x")), true).is_some(),
            "handed over, not started: merges in the work queue"
        );
        assert!(a.admit(ObjectRef::from_obj(&cm("a", "y")), true).is_some());
        assert!(
            a.admit(ObjectRef::from_obj(&cm("a", "z")), true).is_none(),
            "two of four wait: no room"
        );
        assert_eq!(a.take(Instant::now(), true), Err(Some(POLL)));
        a.started("a/x");
        assert_eq!(
            a.take(Instant::now(), true).map(|r| names(&r)),
            Ok(vec!["a/z".to_string()])
        );
    }

    #[test]
    fn a_burst_in_one_namespace_takes_turns_with_the_others() {
        let mut objects: Vec<ConfigMap> = (0..100).map(|i| cm("burst", &format!("b{i}"))).collect();
        objects.extend((0..3).map(|i| cm(&format!("quiet{i}"), "q")));
        let a = admission(4, None, &objects);
        let mut straight = 0;
        for o in &objects[..100] {
            straight += usize::from(a.admit(ObjectRef::from_obj(o), true).is_some());
        }
        assert_eq!(straight, 2, "half a batch goes straight on, the rest waits");
        for o in &objects[100..] {
            assert!(
                a.admit(ObjectRef::from_obj(o), true).is_none(),
                "the burst waits: so does this"
            );
        }
        assert_eq!(a.waiting(), 101);
        // The reconciles handed over start: the next batch alternates the burst and the others.
        a.started("burst/b0");
        a.started("burst/b1");
        let batch = names(&a.take(Instant::now(), true).expect("room"));
        assert_eq!(batch, ["burst/b2", "quiet0/q", "quiet1/q", "quiet2/q"]);
        for r in &batch {
            a.started(r);
        }
        let batch = names(&a.take(Instant::now(), true).expect("room"));
        assert_eq!(
            batch,
            ["burst/b3", "burst/b4", "burst/b5", "burst/b6"],
            "the burst is not starved"
        );
        assert!(
            a.admit(ObjectRef::from_obj(&cm("burst", "b7")), true).is_none(),
            "waiting: once"
        );
        assert_eq!(a.waiting(), 93);
    }

    #[test]
    fn an_author_key_groups_the_lines() {
        let objects: Vec<ConfigMap> = ["t1-a", "t1-b", "t1-c", "t2-a", "t1-d"]
            .iter()
            .map(|n| cm(&format!("ns-{n}"), n))
            .collect();
        let tenant: GroupFn<ConfigMap> =
            Arc::new(|c: &ConfigMap| c.metadata.name.clone().unwrap_or_default()[..2].to_string());
        let a = admission(2, Some(tenant), &objects);
        let admitted: Vec<bool> = objects
            .iter()
            .map(|o| a.admit(ObjectRef::from_obj(o), true).is_some())
            .collect();
        assert_eq!(
            admitted,
            [true, false, false, false, false],
            "one handed over fills a batch of two"
        );
        assert_eq!(a.take(Instant::now(), true), Err(Some(POLL)));
        a.started("ns-t1-a/t1-a");
        let batch = names(&a.take(Instant::now(), true).expect("room"));
        assert_eq!(
            batch,
            ["ns-t1-b/t1-b", "ns-t2-a/t2-a"],
            "tenants, not namespaces, take turns"
        );
    }

    #[test]
    fn gone_objects_and_standbys_and_fifo() {
        let a = admission(2, None, &[cm("a", "first"), cm("a", "here")]);
        assert!(a.admit(ObjectRef::from_obj(&cm("a", "first")), true).is_some());
        assert!(a.admit(ObjectRef::from_obj(&cm("a", "gone")), true).is_none());
        assert!(a.admit(ObjectRef::from_obj(&cm("a", "here")), true).is_none());
        a.started("a/first");
        assert_eq!(
            a.take(Instant::now(), true).map(|r| names(&r)),
            Ok(vec!["a/here".to_string()]),
            "gone: dropped"
        );
        assert!(
            a.admit(ObjectRef::from_obj(&cm("b", "x")), false).is_some(),
            "a standby passes on"
        );
        let (store, _) = Cache::empty(false);
        let fifo: Arc<Admission<ConfigMap>> = Admission::new(2, false, None, store, true);
        for i in 0..10 {
            assert!(
                fifo.admit(ObjectRef::new(&format!("o{i}")).within("a"), true)
                    .is_some()
            );
        }
        let (store, _) = Cache::empty(false);
        let unlimited: Arc<Admission<ConfigMap>> = Admission::new(0, true, None, store, true);
        assert!(
            unlimited.admit(ObjectRef::new("o").within("a"), true).is_some(),
            "no limit: no line"
        );
    }

    #[test]
    fn while_the_primary_lists_nothing_waiting_is_dropped_or_taken_for_lost() {
        // The store holds the listed objects only once the list ends.
        let (store, mut writer) = Cache::empty(false);
        let a: Arc<Admission<ConfigMap>> = Admission::new(2, true, None, store, true);
        a.follow::<()>(&Ok(kube::runtime::watcher::Event::Init));
        let objects: Vec<ConfigMap> = (0..4).map(|i| cm("a", &format!("o{i}"))).collect();
        let admitted: Vec<bool> = objects
            .iter()
            .map(|o| a.admit(ObjectRef::from_obj(o), true).is_some())
            .collect();
        assert_eq!(admitted, [true, false, false, false]);
        let now = Instant::now();
        // The reconcile handed on waits for the sync: still counted after STALE.
        assert_eq!(a.take(now + STALE, true), Err(Some(POLL)));
        // Counted as lost after LOST: what waits goes on, not dropped, though not cached yet.
        assert_eq!(a.take(now + LOST, true).map(|r| r.len()), Ok(2));
        writer.apply(&kube::runtime::watcher::Event::Init);
        for o in &objects {
            writer.apply(&kube::runtime::watcher::Event::InitApply(o.clone()));
        }
        writer.apply(&kube::runtime::watcher::Event::InitDone);
        a.follow::<()>(&Ok(kube::runtime::watcher::Event::InitDone));
        a.started("a/o1");
        a.started("a/o2");
        assert_eq!(
            a.take(now + LOST, true).map(|r| names(&r)),
            Ok(vec!["a/o3".to_string()])
        );
    }

    #[test]
    fn a_replica_that_stops_leading_passes_everything_on() {
        let objects: Vec<ConfigMap> = (0..5).map(|i| cm("a", &format!("o{i}"))).collect();
        let a = admission(2, None, &objects);
        for o in &objects {
            a.admit(ObjectRef::from_obj(o), true);
        }
        assert_eq!(a.waiting(), 4);
        assert_eq!(a.take(Instant::now(), false).map(|r| r.len()), Ok(4));
        assert_eq!(a.waiting(), 0);
        assert!(
            a.admit(ObjectRef::from_obj(&objects[0]), true).is_some(),
            "what was handed on before no longer counts"
        );
    }

    #[test]
    fn a_cluster_scoped_kind_is_keyed_without_a_namespace() {
        use k8s_openapi::api::core::v1::Namespace;
        let (store, _) = Cache::empty(false);
        let a: Arc<Admission<Namespace>> = Admission::new(2, true, None, store, false);
        a.follow::<()>(&Ok(kube::runtime::watcher::Event::InitDone));
        assert!(a.admit(ObjectRef::new("x").within("mapped"), true).is_some());
        assert!(
            a.admit(ObjectRef::new("y"), true).is_none(),
            "one handed on fills a batch of two"
        );
        a.started("/x");
        assert_eq!(
            a.take(Instant::now(), true),
            Err(None),
            "x started; y, not cached, dropped"
        );
    }
}
