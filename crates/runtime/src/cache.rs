//! What a controller reads: [`Cache`]s of watched kinds, and the [`Watch`] options that decide
//! what they hold (selector, trim, projection, named indexes) and which changes trigger a
//! reconcile.
use std::collections::{HashMap, HashSet};
use std::hash::Hash;
use std::sync::{Arc, RwLock};

use kube::core::{ApiResource, DynamicObject};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::watcher;
use kube::{Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::changed::hash;
use crate::kind::ResolvedKind;

/// The index every pruned watch keeps: cached objects by the uid of the primary object that
/// controls them (owner reference) or names itself in [`crate::OWNER_LABEL`], so that pruning
/// one primary's orphans does not scan every cached object.
pub(crate) const OWNER_INDEX: &str = "opkit.dev/owner";

/// A read-only cache of one kind in one watch scope, filled by a watch opkit runs.
///
/// Reads never block; by the time a reconcile runs, the cache has seen the watch's initial
/// list.
pub struct Cache<C: Resource<DynamicType = ()> + Clone + 'static> {
    store: Store<C>,
    indexes: Indexes<C>,
}

impl<C: Resource<DynamicType = ()> + Clone + 'static> Clone for Cache<C> {
    fn clone(&self) -> Self {
        Cache {
            store: self.store.clone(),
            indexes: self.indexes.clone(),
        }
    }
}

/// How an index keys an object: any number of keys (none leaves it out).
pub(crate) type KeyFn<C> = Arc<dyn Fn(&C) -> Vec<String> + Send + Sync>;

/// The named indexes of one cache. Declared before the watch starts; shared by every clone.
pub(crate) type Indexes<C> = Arc<RwLock<HashMap<&'static str, Arc<Index<C>>>>>;

/// Cached objects by keys of the controller's (e.g. the primary a Pod belongs to), kept
/// beside the store so that finding one object's children does not scan every object.
pub(crate) struct Index<C: Resource<DynamicType = ()>> {
    key: KeyFn<C>,
    maps: RwLock<IndexMaps<C>>,
}

struct IndexMaps<C: Resource<DynamicType = ()>> {
    by_key: HashMap<String, HashSet<ObjectRef<C>>>,
    keys_of: HashMap<ObjectRef<C>, Vec<String>>,
    /// Filled during a relist and swapped in when it is complete, as the store does.
    relist: Option<Box<IndexMaps<C>>>,
}

impl<C: Resource<DynamicType = ()>> Default for IndexMaps<C> {
    fn default() -> Self {
        IndexMaps {
            by_key: Default::default(),
            keys_of: Default::default(),
            relist: None,
        }
    }
}

impl<C: Resource<DynamicType = ()>> IndexMaps<C> {
    fn remove(&mut self, r: &ObjectRef<C>) {
        for old in self.keys_of.remove(r).unwrap_or_default() {
            if let Some(set) = self.by_key.get_mut(&old) {
                set.remove(r);
                if set.is_empty() {
                    self.by_key.remove(&old);
                }
            }
        }
    }

    fn insert(&mut self, r: ObjectRef<C>, keys: Vec<String>) {
        self.remove(&r);
        if keys.is_empty() {
            return;
        }
        for key in &keys {
            self.by_key.entry(key.clone()).or_default().insert(r.clone());
        }
        self.keys_of.insert(r, keys);
    }
}

impl<C: Resource<DynamicType = ()> + Clone> Index<C> {
    pub(crate) fn new(key: KeyFn<C>) -> Self {
        Index {
            key,
            maps: Default::default(),
        }
    }

    pub(crate) fn observe(&self, ev: &watcher::Event<C>) {
        let mut maps = self.maps.write().unwrap_or_else(|p| p.into_inner());
        match ev {
            watcher::Event::Apply(o) => maps.insert(ObjectRef::from_obj(o), (self.key)(o)),
            watcher::Event::Delete(o) => maps.remove(&ObjectRef::from_obj(o)),
            watcher::Event::Init => maps.relist = Some(Box::default()),
            watcher::Event::InitApply(o) => {
                let keys = (self.key)(o);
                if let Some(next) = maps.relist.as_mut() {
                    next.insert(ObjectRef::from_obj(o), keys);
                }
            }
            watcher::Event::InitDone => {
                if let Some(next) = maps.relist.take() {
                    *maps = *next;
                }
            }
        }
    }

    fn refs(&self, key: &str) -> Vec<ObjectRef<C>> {
        let maps = self.maps.read().unwrap_or_else(|p| p.into_inner());
        maps.by_key
            .get(key)
            .map(|refs| refs.iter().cloned().collect())
            .unwrap_or_default()
    }
}

/// Feeds every index of a cache one watch event.
pub(crate) fn observe_all<C: Resource<DynamicType = ()> + Clone>(
    indexes: &Indexes<C>,
    ev: &watcher::Event<C>,
) {
    let indexes = indexes.read().unwrap_or_else(|p| p.into_inner());
    for index in indexes.values() {
        index.observe(ev);
    }
}

/// Objects sampled to estimate a cache's size.
const SIZE_SAMPLE: usize = 32;

impl<C: Resource<DynamicType = ()> + Clone + 'static> Cache<C> {
    pub(crate) fn new(store: Store<C>, indexes: Indexes<C>) -> Self {
        Cache { store, indexes }
    }

    pub(crate) fn store(&self) -> Store<C> {
        self.store.clone()
    }

    pub(crate) fn indexes(&self) -> &Indexes<C> {
        &self.indexes
    }

    /// Adds an index; only before the watch filling this cache starts. A cache shared by
    /// several controllers shares its indexes too: the first declaration of a name wins.
    pub(crate) fn add_index(&self, name: &'static str, key: KeyFn<C>) {
        let mut indexes = self.indexes.write().unwrap_or_else(|p| p.into_inner());
        indexes.entry(name).or_insert_with(|| Arc::new(Index::new(key)));
    }

    /// A cache holding `objects` as `watch` would keep them (trimmed, projected, indexed; its
    /// label selector is not evaluated): for unit tests of [`crate::Reconciler::observe`] and
    /// of mappers, with no cluster.
    pub fn from_objects(watch: &Watch<C>, objects: impl IntoIterator<Item = C>) -> Self
    where
        C: Serialize + DeserializeOwned,
    {
        let (store, mut writer) = reflector::store();
        let cache = Cache::new(store, Indexes::default());
        for (name, key) in &watch.indexes {
            cache.add_index(name, key.clone());
        }
        for mut o in objects {
            if let Some(manager) = &watch.applied {
                keep_applied(&mut o, manager);
            }
            o.managed_fields_mut().clear();
            if let Some(t) = &watch.trim {
                (t.apply)(&mut o);
            }
            let ev = watcher::Event::Apply(o);
            observe_all(&cache.indexes, &ev);
            writer.apply_watcher_event(&ev);
        }
        cache
    }

    /// (objects, estimated bytes) of the cache ([`measure`]).
    pub(crate) fn measure(&self) -> (usize, usize)
    where
        C: Serialize,
    {
        measure(&self.store)
    }

    /// The cached objects that the index `name` ([`Watch::index`]) keys under `key`, without
    /// scanning the others. Empty when there is no such index.
    pub fn indexed(&self, name: &str, key: &str) -> Vec<Arc<C>> {
        self.indexed_refs(name, key)
            .iter()
            .filter_map(|r| self.store.get(r))
            .collect()
    }

    /// References to the objects [`Cache::indexed`] returns: what a mapper hands back.
    pub fn indexed_refs(&self, name: &str, key: &str) -> Vec<ObjectRef<C>> {
        let index = self
            .indexes
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(name)
            .cloned();
        index.map(|i| i.refs(key)).unwrap_or_default()
    }

    /// The object `name` in `namespace` (empty for a cluster-scoped kind), if cached.
    pub fn get(&self, namespace: &str, name: &str) -> Option<Arc<C>> {
        let r = ObjectRef::new(name);
        self.store.get(&if namespace.is_empty() {
            r
        } else {
            r.within(namespace)
        })
    }

    /// Every cached object (of every namespace this cache covers).
    pub fn all(&self) -> Vec<Arc<C>> {
        self.store.state()
    }

    /// The cached objects for which `f` holds.
    pub fn filter(&self, f: impl Fn(&C) -> bool) -> Vec<Arc<C>> {
        self.store.state().into_iter().filter(|o| f(o)).collect()
    }

    /// How many objects are cached.
    pub fn len(&self) -> usize {
        self.store.len()
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.store.is_empty()
    }
}

/// (objects, estimated bytes): the JSON size of a sample of the stored objects, scaled to
/// all of them. JSON is not the in-memory layout, but it moves with what is cached, so a
/// trim or a label selector shows up in it.
pub(crate) fn measure<C>(store: &Store<C>) -> (usize, usize)
where
    C: Resource<DynamicType: Eq + Hash + Clone> + Serialize + Clone + 'static,
{
    let all = store.state();
    let step = (all.len() / SIZE_SAMPLE).max(1);
    let sample: Vec<usize> = all
        .iter()
        .step_by(step)
        .take(SIZE_SAMPLE)
        .map(|o| serde_json::to_vec(o.as_ref()).map_or(0, |v| v.len()))
        .collect();
    match sample.len() {
        0 => (all.len(), 0),
        k => (all.len(), sample.iter().sum::<usize>() * all.len() / k),
    }
}

/// A read-only cache of a kind named at run time ([`crate::Watches::dynamic`]): its objects
/// as `DynamicObject`s, and the kind as discovery found it.
///
/// Empty while the apiserver does not serve the kind.
#[derive(Clone)]
pub struct DynamicCache {
    store: Store<DynamicObject>,
    /// The store's key of every object (any one value will do, as long as it is this one).
    keyed: ApiResource,
    resolved: Arc<RwLock<Option<ResolvedKind>>>,
}

impl DynamicCache {
    pub(crate) fn new(store: Store<DynamicObject>, keyed: ApiResource) -> Self {
        DynamicCache {
            store,
            keyed,
            resolved: Arc::default(),
        }
    }

    pub(crate) fn store(&self) -> Store<DynamicObject> {
        self.store.clone()
    }

    pub(crate) fn resolve(&self, kind: ResolvedKind) {
        *self.resolved.write().unwrap_or_else(|p| p.into_inner()) = Some(kind);
    }

    /// The kind is no longer served.
    pub(crate) fn unresolve(&self) {
        *self.resolved.write().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// A cache holding `objects` of `kind` as its watch would (its label selector is not
    /// evaluated, nor its trim): for unit tests of `observe`, with no cluster.
    pub fn from_objects(kind: ResolvedKind, objects: impl IntoIterator<Item = DynamicObject>) -> Self {
        let keyed = kind.resource.clone();
        let mut writer = reflector::store::Writer::new(keyed.clone());
        let store = writer.as_reader();
        for o in objects {
            writer.apply_watcher_event(&watcher::Event::Apply(o));
        }
        let cache = DynamicCache::new(store, keyed);
        cache.resolve(kind);
        cache
    }

    /// The kind as the apiserver serves it (its kind, plural and scope), for the children and
    /// deletions of its objects; `None` until discovery has found it.
    pub fn kind(&self) -> Option<ResolvedKind> {
        self.resolved.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The object `name` in `namespace` (empty for a cluster-scoped kind), if cached.
    pub fn get(&self, namespace: &str, name: &str) -> Option<Arc<DynamicObject>> {
        let r = ObjectRef::new_with(name, self.keyed.clone());
        self.store.get(&if namespace.is_empty() {
            r
        } else {
            r.within(namespace)
        })
    }

    /// Every cached object.
    pub fn all(&self) -> Vec<Arc<DynamicObject>> {
        self.store.state()
    }

    /// The cached objects for which `f` holds.
    pub fn filter(&self, f: impl Fn(&DynamicObject) -> bool) -> Vec<Arc<DynamicObject>> {
        self.store.state().into_iter().filter(|o| f(o)).collect()
    }

    /// How many objects are cached.
    pub fn len(&self) -> usize {
        self.store.len()
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.store.is_empty()
    }
}

/// What a watch drops from each object before caching it ([`Watch::trim`]).
pub(crate) struct Trim<C> {
    pub(crate) apply: Arc<dyn Fn(&mut C) + Send + Sync>,
    pub(crate) key: TrimKey,
}

impl<C> Clone for Trim<C> {
    fn clone(&self) -> Self {
        Trim {
            apply: self.apply.clone(),
            key: self.key,
        }
    }
}

/// Which trim a watch has, for sharing caches: stable for the life of the process (a function
/// pointer's address is not: one function may have several, two may share one).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub(crate) enum TrimKey {
    /// The type of a function or of a closure that captures nothing.
    Type(std::any::TypeId),
    /// A trim never taken for another.
    Unique(u64),
}

/// Which objects of kind `C` a watch caches and what it keeps of each.
pub struct Watch<C> {
    pub(crate) labels: Option<String>,
    pub(crate) fields: Option<String>,
    pub(crate) trim: Option<Trim<C>>,
    pub(crate) prune: bool,
    /// The field manager whose applied fields are kept (see [`Watch::applied`]); filled in
    /// with the controller's when the watch is built.
    pub(crate) applied: Option<String>,
    pub(crate) indexes: Vec<(&'static str, KeyFn<C>)>,
    pub(crate) filter: Option<Filter<C>>,
    pub(crate) optional: bool,
    pub(crate) fair_by: Option<GroupFn<C>>,
}

impl<C> Watch<C> {
    /// Every object of the kind in scope.
    pub fn all() -> Self {
        Watch {
            labels: None,
            fields: None,
            trim: None,
            prune: false,
            applied: None,
            indexes: Vec::new(),
            filter: None,
            optional: false,
            fair_by: None,
        }
    }

    /// Only objects matching a label selector (`app=x,tier`): the cheapest way to keep
    /// unrelated objects out of memory.
    pub fn labels(selector: &str) -> Self {
        Watch {
            labels: Some(selector.into()),
            ..Self::all()
        }
    }

    /// Also a field selector (`status.phase!=Failed`): the apiserver filters, so objects that
    /// leave it arrive as deletions, and a controller that only needed a field to filter on
    /// can watch metadata alone (`kube::core::PartialObjectMeta<Pod>`: the apiserver then
    /// sends and opkit decodes and caches only metadata).
    pub fn fields(mut self, selector: &str) -> Self {
        self.fields = Some(selector.into());
        self
    }

    /// Drops what the controller never reads before the object is cached (managed fields are
    /// always dropped).
    pub fn trim<F: Fn(&mut C) + Send + Sync + 'static>(mut self, trim: F) -> Self {
        // A function or a closure that captures nothing is known by its type, which no other
        // has: watches with the same one can share a cache. Anything else (a function pointer,
        // a closure holding values) is never taken for another.
        let key = if std::mem::size_of::<F>() == 0 {
            TrimKey::Type(std::any::TypeId::of::<F>())
        } else {
            static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
            TrimKey::Unique(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
        };
        self.trim = Some(Trim {
            apply: Arc::new(trim),
            key,
        });
        self
    }

    /// Keeps the cached objects findable by the keys `key` gives each of them, under the
    /// index `name` ([`Cache::indexed`]; controller-runtime's `IndexField`): a plan that
    /// reads the children of one primary then costs the same with ten or ten thousand
    /// primaries. `key` returns any number of keys (an `Option` works); a watch can declare
    /// any number of indexes.
    pub fn index<I>(mut self, name: &'static str, key: impl Fn(&C) -> I + Send + Sync + 'static) -> Self
    where
        I: IntoIterator<Item = String>,
    {
        self.indexes
            .push((name, Arc::new(move |c: &C| key(c).into_iter().collect())));
        self
    }

    /// Caches only the fields this controller applied (its `managedFields`), plus identity,
    /// owner references and status: enough for the no-op check of the children it applies,
    /// with a field another manager took over showing as drift — and a fraction of the
    /// memory of whole objects. For kinds the plan writes with [`crate::Child::apply`] and
    /// reads nothing else of but status; objects it never applied are cached whole.
    pub fn applied(mut self) -> Self {
        self.applied = Some(String::new());
        self
    }

    /// Deletes cached objects controlled by the primary object (owner reference, or
    /// [`crate::OWNER_LABEL`] where Kubernetes allows no owner reference) that the plan no
    /// longer produces (a renamed child, a namespace that stopped matching, a feature turned
    /// off), in whatever namespace they are. Only those in the cache when the reconcile
    /// observed, each only if it is still that object (uid precondition): one that arrives
    /// later is the next reconcile's to judge.
    pub fn prune(mut self) -> Self {
        self.prune = true;
        self
    }

    /// For a kind that may not be installed (another operator's CRD): while the apiserver
    /// does not serve it, the cache is empty and the controller is ready without it; once
    /// the kind is served (within about 5 s) it is listed and watched, and when the kind
    /// goes, its objects leave the cache as deletions. Installed when the controller starts,
    /// it is waited for as any watch is; installed later, its listed objects reconcile the
    /// primaries they map to once the list is in the cache. `/readyz` and
    /// `opkit_optional_watch_active` name the watches waiting. The primary kind is never
    /// optional: a controller of a kind that is not there has nothing to do.
    pub fn optional(mut self) -> Self {
        self.optional = true;
        self
    }

    /// For the primary watch: the key whose objects share one line in the work queue, the
    /// lines taking turns (the `fair-queue` tuning), in place of the namespace — a tenant
    /// label, say, when one tenant's objects span namespaces. Objects with the same key keep
    /// their order; a burst under one key delays the others by one request per round. A
    /// watch of another kind does not queue its objects and ignores it.
    pub fn fair_by(mut self, key: impl Fn(&C) -> String + Send + Sync + 'static) -> Self {
        self.fair_by = Some(Arc::new(key));
        self
    }
}

/// The line of the work queue an object's requests wait in ([`Watch::fair_by`]).
pub(crate) type GroupFn<C> = Arc<dyn Fn(&C) -> String + Send + Sync>;

/// What part of an object a watch reacts to ([`Watch::on_change`]), as a hash.
pub(crate) type Filter<C> = Arc<dyn Fn(&C) -> u64 + Send + Sync>;

impl<C> Watch<C> {
    /// Reconciles only when `key` of an object changes (or the object is created, recreated
    /// or deleted): controller-runtime's predicates. The cache still follows every change.
    /// [`crate::changed`] has the usual keys; combine them in a tuple, e.g.
    /// `.on_change(|d: &Deployment| (changed::generation(d), changed::labels(d)))`.
    pub fn on_change<H: Hash>(mut self, key: impl Fn(&C) -> H + Send + Sync + 'static) -> Self {
        self.filter = Some(Arc::new(move |c: &C| hash(&key(c))));
        self
    }
}

/// Replaces `obj` by what `manager` applied to it ([`crate::diff::applied_by`]); leaves it
/// whole when the manager applied nothing or the projection does not make a valid object.
pub(crate) fn keep_applied<C: Serialize + DeserializeOwned>(obj: &mut C, manager: &str) {
    let Ok(value) = serde_json::to_value(&*obj) else {
        return;
    };
    if let Some(projected) = crate::diff::applied_by(&value, manager)
        && let Ok(trimmed) = serde_json::from_value(projected)
    {
        *obj = trimmed;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strip_annotations(cm: &mut k8s_openapi::api::core::v1::ConfigMap) {
        cm.metadata.annotations = None;
    }

    fn strip_labels(cm: &mut k8s_openapi::api::core::v1::ConfigMap) {
        cm.metadata.labels = None;
    }

    #[test]
    fn watches_share_a_cache_only_with_the_same_trim() {
        use k8s_openapi::api::core::v1::ConfigMap;
        let key = |w: Watch<ConfigMap>| w.trim.map(|t| t.key);
        assert_eq!(key(Watch::all()), None);
        assert_eq!(
            key(Watch::all().trim(strip_annotations)),
            key(Watch::all().trim(strip_annotations))
        );
        assert_ne!(
            key(Watch::all().trim(strip_annotations)),
            key(Watch::all().trim(strip_labels))
        );
        // A function pointer, or a closure holding a value, could be anything: never shared.
        let pointer: fn(&mut ConfigMap) = strip_annotations;
        assert_ne!(key(Watch::all().trim(pointer)), key(Watch::all().trim(pointer)));
        let keep = String::from("x");
        let holding = move |cm: &mut ConfigMap| cm.metadata.name = Some(keep.clone());
        assert_ne!(
            key(Watch::all().trim(holding.clone())),
            key(Watch::all().trim(holding))
        );
    }
    use k8s_openapi::api::core::v1::Pod;

    fn pod(name: &str, owners: &str) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "ns", "labels": {"owners": owners}}
        }))
        .expect("pod")
    }

    fn owners(p: &Pod) -> Vec<String> {
        p.labels()
            .get("owners")
            .map(|o| o.split('.').filter(|s| !s.is_empty()).map(String::from).collect())
            .unwrap_or_default()
    }

    fn keyed(i: &Index<Pod>, key: &str) -> Vec<String> {
        let mut names: Vec<String> = i.refs(key).into_iter().map(|r| r.name).collect();
        names.sort();
        names
    }

    #[test]
    fn the_index_follows_applies_relabels_deletes_and_swaps_in_a_relist_when_complete() {
        let i = Index::new(Arc::new(owners));
        i.observe(&watcher::Event::Apply(pod("a", "m1")));
        i.observe(&watcher::Event::Apply(pod("b", "m1.m2")));
        assert_eq!(
            (keyed(&i, "m1"), keyed(&i, "m2")),
            (vec!["a".into(), "b".into()], vec!["b".into()])
        );
        i.observe(&watcher::Event::Apply(pod("b", "m2")));
        assert_eq!(
            (keyed(&i, "m1"), keyed(&i, "m2")),
            (vec!["a".into()], vec!["b".into()])
        );
        i.observe(&watcher::Event::Apply(pod("a", "")));
        assert!(keyed(&i, "m1").is_empty());
        i.observe(&watcher::Event::Apply(pod("a", "m1")));
        i.observe(&watcher::Event::Delete(pod("a", "m1")));
        assert!(keyed(&i, "m1").is_empty());
        // During a relist the old entries still answer; the new ones replace them at InitDone.
        i.observe(&watcher::Event::Init);
        i.observe(&watcher::Event::InitApply(pod("c", "m1")));
        assert_eq!((keyed(&i, "m1"), keyed(&i, "m2")), (vec![], vec!["b".into()]));
        i.observe(&watcher::Event::InitDone);
        assert_eq!((keyed(&i, "m1"), keyed(&i, "m2")), (vec!["c".into()], vec![]));
    }

    #[test]
    fn a_cache_built_from_objects_answers_like_a_watched_one() {
        let watch = Watch::all()
            .trim(|p: &mut Pod| p.metadata.annotations = None)
            .index("owner", owners)
            .index("name", |p: &Pod| Some(p.name_any()));
        let mut annotated = pod("a", "m1");
        annotated.metadata.annotations = Some([("big".to_string(), "x".repeat(100))].into());
        let cache = Cache::from_objects(&watch, [annotated, pod("b", "m1.m2")]);
        assert_eq!(cache.len(), 2);
        let a = cache.get("ns", "a").expect("a is cached");
        assert!(a.metadata.annotations.is_none(), "the watch's trim applies");
        let mut names: Vec<String> = cache
            .indexed("owner", "m1")
            .iter()
            .map(|p| p.name_any())
            .collect();
        names.sort();
        assert_eq!(names, ["a", "b"]);
        assert_eq!(cache.indexed("name", "b").len(), 1);
        assert!(cache.indexed("no-such-index", "m1").is_empty());
        assert_eq!(
            cache.indexed_refs("owner", "m2"),
            [ObjectRef::new("b").within("ns")]
        );
    }
}
