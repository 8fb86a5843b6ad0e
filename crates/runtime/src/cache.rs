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
    storage: Storage<C>,
    indexes: Indexes<C>,
}

impl<C: Resource<DynamicType = ()> + Clone + 'static> Clone for Cache<C> {
    fn clone(&self) -> Self {
        Cache {
            storage: self.storage.clone(),
            indexes: self.indexes.clone(),
        }
    }
}

/// Where a cache keeps its objects.
enum Storage<C: Resource<DynamicType = ()> + Clone + 'static> {
    /// As decoded: a read hands out the stored object.
    Typed(Store<C>),
    /// Encoded ([`Watch::compact`]): a read decodes a copy.
    Compact(Arc<RwLock<Encoded>>),
}

impl<C: Resource<DynamicType = ()> + Clone + 'static> Clone for Storage<C> {
    fn clone(&self) -> Self {
        match self {
            Storage::Typed(s) => Storage::Typed(s.clone()),
            Storage::Compact(m) => Storage::Compact(m.clone()),
        }
    }
}

/// Objects as their JSON, by `namespace/name`, each an LZ4 block compressed against the JSON of
/// one of them: a k8s-openapi struct holds every optional field inline (a Deployment's
/// `PodSpec` and `Container`s are 3.6 KiB before any value), so a cached Deployment takes
/// about 9 KiB decoded and 1.6 KiB as JSON; what it repeats is mostly in its siblings (the
/// same controller built them), which a dictionary of one sibling takes out: about 170 bytes.
#[derive(Default)]
pub(crate) struct Encoded {
    objects: HashMap<Box<str>, Box<[u8]>>,
    /// The JSON of the first object stored into an empty map; a relist, which fills a new
    /// map, chooses again.
    dict: Box<[u8]>,
}

impl Encoded {
    /// Stores an object's JSON (serialised before the lock is taken: readers wait only for
    /// the compression).
    fn insert(&mut self, key: Box<str>, json: Vec<u8>) {
        if self.objects.is_empty() {
            // No stored object depends on the old dictionary.
            self.dict = json.clone().into_boxed_slice();
        }
        let block = lz4_flex::block::compress_prepend_size_with_dict(&json, &self.dict);
        self.objects.insert(key, block.into_boxed_slice());
    }

    fn decode<C: DeserializeOwned>(&self, block: &[u8]) -> Option<Arc<C>> {
        match lz4_flex::block::decompress_size_prepended_with_dict(block, &self.dict) {
            Ok(json) => decode(&json),
            Err(e) => {
                tracing::error!(error = %e, kind = std::any::type_name::<C>(), "a compact cache's object does not decompress");
                None
            }
        }
    }

    fn get<C: DeserializeOwned>(&self, key: &str) -> Option<Arc<C>> {
        self.decode(self.objects.get(key)?)
    }

    /// The block of `r`'s object; as kube's `Store` does, one of a cluster-scoped kind is
    /// found by a reference that names a namespace too (a mapper's, say).
    fn find<C: Resource<DynamicType = ()>>(&self, r: &ObjectRef<C>) -> Option<&[u8]> {
        let at = |namespace| self.objects.get(&encoded_key(namespace, &r.name)).map(|b| &**b);
        at(r.namespace.as_deref()).or_else(|| r.namespace.as_ref().and_then(|_| at(None)))
    }

    /// Bytes held: keys, blocks and the dictionary.
    fn bytes(&self) -> usize {
        let each: usize = self.objects.iter().map(|(k, v)| k.len() + v.len()).sum();
        each + self.dict.len()
    }
}

fn encoded_key(namespace: Option<&str>, name: &str) -> Box<str> {
    format!("{}/{name}", namespace.unwrap_or_default()).into_boxed_str()
}

fn encoded_key_of<C: Resource>(o: &C) -> Box<str> {
    encoded_key(o.meta().namespace.as_deref(), &o.name_any())
}

/// What fills a cache from its watch's events, as kube's reflector fills a store: a list
/// replaces the contents once it is complete.
pub(crate) enum CacheWriter<C: Resource<DynamicType = ()> + Clone + 'static> {
    Typed(reflector::store::Writer<C>),
    Compact {
        objects: Arc<RwLock<Encoded>>,
        relist: Option<Encoded>,
    },
}

impl<C: Resource<DynamicType = ()> + Clone + Serialize + 'static> CacheWriter<C> {
    pub(crate) fn apply(&mut self, ev: &watcher::Event<C>) {
        let (objects, relist) = match self {
            CacheWriter::Typed(w) => return w.apply_watcher_event(ev),
            CacheWriter::Compact { objects, relist } => (objects, relist),
        };
        let write = || objects.write().unwrap_or_else(|p| p.into_inner());
        let json = |o: &C| serde_json::to_vec(o).unwrap_or_default();
        match ev {
            watcher::Event::Apply(o) => {
                let json = json(o);
                write().insert(encoded_key_of(o), json);
            }
            watcher::Event::Delete(o) => {
                write().objects.remove(&*encoded_key_of(o));
            }
            watcher::Event::Init => *relist = Some(Encoded::default()),
            watcher::Event::InitApply(o) => relist.get_or_insert_default().insert(encoded_key_of(o), json(o)),
            watcher::Event::InitDone => {
                let mut next = relist.take().unwrap_or_default();
                next.objects.shrink_to_fit();
                *write() = next;
            }
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
    maps: RwLock<IndexMaps>,
}

/// An indexed object, by `namespace/name`: shared by its keys' entries and its own.
type Id = Arc<str>;

/// The objects under one key: almost always one (a child's owner, an object's uid).
enum Ids {
    One(Id),
    Many(HashSet<Id>),
}

impl Ids {
    fn insert(&mut self, id: Id) {
        match self {
            Ids::One(one) if *one == id => {}
            Ids::One(one) => *self = Ids::Many(HashSet::from([one.clone(), id])),
            Ids::Many(many) => {
                many.insert(id);
            }
        }
    }

    /// Removes `id`; whether none is left.
    fn remove(&mut self, id: &str) -> bool {
        match self {
            Ids::One(one) => &**one == id,
            Ids::Many(many) => {
                many.remove(id);
                many.is_empty()
            }
        }
    }

    fn iter(&self) -> impl Iterator<Item = &Id> {
        let (one, many) = match self {
            Ids::One(one) => (Some(one), None),
            Ids::Many(many) => (None, Some(many.iter())),
        };
        one.into_iter().chain(many.into_iter().flatten())
    }
}

/// About a quarter of the memory of sets of `ObjectRef`s (cache_memory bench): an `ObjectRef` carries four strings
/// (the resourceVersion and uid too), and a set of one still allocates room for three.
#[derive(Default)]
struct IndexMaps {
    by_key: HashMap<Arc<str>, Ids>,
    keys_of: HashMap<Id, Box<[Arc<str>]>>,
    /// Filled during a relist and swapped in when it is complete, as the store does.
    relist: Option<Box<IndexMaps>>,
}

impl IndexMaps {
    fn remove(&mut self, id: &str) {
        for old in self.keys_of.remove(id).unwrap_or_default() {
            if self.by_key.get_mut(&old).is_some_and(|ids| ids.remove(id)) {
                self.by_key.remove(&old);
            }
        }
    }

    fn insert(&mut self, id: Id, keys: Vec<String>) {
        // Most updates (a status, a new resourceVersion) keep an object's keys.
        if self
            .keys_of
            .get(&id)
            .is_some_and(|old| old.len() == keys.len() && old.iter().zip(&keys).all(|(a, b)| **a == **b))
        {
            return;
        }
        self.remove(&id);
        if keys.is_empty() {
            return;
        }
        let mut kept = Vec::with_capacity(keys.len());
        for key in keys {
            // One copy of a key for all its entries.
            let shared = self.by_key.get_key_value(key.as_str()).map(|(k, _)| k.clone());
            match shared {
                Some(k) => {
                    if let Some(ids) = self.by_key.get_mut(&k) {
                        ids.insert(id.clone());
                    }
                    kept.push(k);
                }
                None => {
                    let k: Arc<str> = key.into();
                    self.by_key.insert(k.clone(), Ids::One(id.clone()));
                    kept.push(k);
                }
            }
        }
        self.keys_of.insert(id, kept.into_boxed_slice());
    }
}

fn id_of<C: Resource>(o: &C) -> Id {
    encoded_key_of(o).into()
}

/// The reference of the object of `id` (`namespace/name`; an empty namespace: none), as an
/// index or the work queue holds it.
pub(crate) fn object_ref<C: Resource<DynamicType = ()>>(id: &str) -> ObjectRef<C> {
    let (namespace, name) = id.split_once('/').unwrap_or(("", id));
    let r = ObjectRef::new(name);
    if namespace.is_empty() {
        r
    } else {
        r.within(namespace)
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
            watcher::Event::Apply(o) => maps.insert(id_of(o), (self.key)(o)),
            watcher::Event::Delete(o) => maps.remove(&id_of(o)),
            watcher::Event::Init => maps.relist = Some(Box::default()),
            watcher::Event::InitApply(o) => {
                let keys = (self.key)(o);
                if let Some(next) = maps.relist.as_mut() {
                    next.insert(id_of(o), keys);
                }
            }
            watcher::Event::InitDone => {
                if let Some(mut next) = maps.relist.take() {
                    next.by_key.shrink_to_fit();
                    next.keys_of.shrink_to_fit();
                    *maps = *next;
                }
            }
        }
    }

    fn refs(&self, key: &str) -> Vec<ObjectRef<C>> {
        let maps = self.maps.read().unwrap_or_else(|p| p.into_inner());
        maps.by_key
            .get(key)
            .map(|ids| ids.iter().map(|id| object_ref(id)).collect())
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
    /// An empty cache that keeps its objects decoded, or encoded (`compact`), and its writer.
    pub(crate) fn empty(compact: bool) -> (Self, CacheWriter<C>) {
        let (storage, writer) = if compact {
            let objects = Arc::<RwLock<Encoded>>::default();
            let writer = CacheWriter::Compact {
                objects: objects.clone(),
                relist: None,
            };
            (Storage::Compact(objects), writer)
        } else {
            let (store, writer) = reflector::store();
            (Storage::Typed(store), CacheWriter::Typed(writer))
        };
        let cache = Cache {
            storage,
            indexes: Indexes::default(),
        };
        (cache, writer)
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
        let (cache, mut writer) = Cache::empty(watch.compact);
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
            writer.apply(&ev);
        }
        cache
    }

    /// (objects, estimated bytes) of the cache ([`measure`]; a compact one counts what it
    /// stores exactly: keys, compressed objects and the dictionary).
    pub(crate) fn measure(&self) -> (usize, usize)
    where
        C: Serialize,
    {
        match &self.storage {
            Storage::Typed(s) => measure(s),
            Storage::Compact(m) => {
                let m = m.read().unwrap_or_else(|p| p.into_inner());
                (m.objects.len(), m.bytes())
            }
        }
    }

    /// The cached objects that the index `name` ([`Watch::index`]) keys under `key`, without
    /// scanning the others. Empty when there is no such index.
    pub fn indexed(&self, name: &str, key: &str) -> Vec<Arc<C>>
    where
        C: DeserializeOwned,
    {
        self.indexed_refs(name, key)
            .iter()
            .filter_map(|r| self.get_ref(r))
            .collect()
    }

    pub(crate) fn get_ref(&self, r: &ObjectRef<C>) -> Option<Arc<C>>
    where
        C: DeserializeOwned,
    {
        match &self.storage {
            Storage::Typed(s) => s.get(r),
            Storage::Compact(m) => {
                let m = m.read().unwrap_or_else(|p| p.into_inner());
                m.decode(m.find(r)?)
            }
        }
    }

    /// The object of `key` (`namespace/name`), if cached: what the work queue hands a run.
    pub(crate) fn get_key(&self, key: &str) -> Option<Arc<C>>
    where
        C: DeserializeOwned,
    {
        match &self.storage {
            Storage::Typed(s) => s.get(&object_ref(key)),
            Storage::Compact(m) => m.read().unwrap_or_else(|p| p.into_inner()).get(key),
        }
    }

    /// Whether `r`'s object is cached, without decoding it.
    pub(crate) fn contains(&self, r: &ObjectRef<C>) -> bool {
        match &self.storage {
            Storage::Typed(s) => s.get(r).is_some(),
            Storage::Compact(m) => m.read().unwrap_or_else(|p| p.into_inner()).find(r).is_some(),
        }
    }

    /// The `namespace/name` of every cached object, without decoding them.
    pub(crate) fn keys(&self) -> Vec<String> {
        match &self.storage {
            Storage::Typed(s) => s
                .state()
                .iter()
                .map(|o| encoded_key_of(o.as_ref()).into())
                .collect(),
            Storage::Compact(m) => {
                let m = m.read().unwrap_or_else(|p| p.into_inner());
                m.objects.keys().map(|k| k.to_string()).collect()
            }
        }
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
    pub fn get(&self, namespace: &str, name: &str) -> Option<Arc<C>>
    where
        C: DeserializeOwned,
    {
        let r = ObjectRef::new(name);
        self.get_ref(&if namespace.is_empty() {
            r
        } else {
            r.within(namespace)
        })
    }

    /// Every cached object (of every namespace this cache covers); a compact cache decodes
    /// each of them.
    pub fn all(&self) -> Vec<Arc<C>>
    where
        C: DeserializeOwned,
    {
        match &self.storage {
            Storage::Typed(s) => s.state(),
            Storage::Compact(m) => {
                let m = m.read().unwrap_or_else(|p| p.into_inner());
                m.objects.values().filter_map(|v| m.decode(v)).collect()
            }
        }
    }

    /// The cached objects for which `f` holds.
    pub fn filter(&self, f: impl Fn(&C) -> bool) -> Vec<Arc<C>>
    where
        C: DeserializeOwned,
    {
        self.all().into_iter().filter(|o| f(o)).collect()
    }

    /// How many objects are cached.
    pub fn len(&self) -> usize {
        match &self.storage {
            Storage::Typed(s) => s.len(),
            Storage::Compact(m) => m.read().unwrap_or_else(|p| p.into_inner()).objects.len(),
        }
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// An object of a compact cache, decoded from its JSON. It was encoded from a decoded object,
/// so this fails only for a type whose serialisation does not read back.
fn decode<C: DeserializeOwned>(bytes: &[u8]) -> Option<Arc<C>> {
    match serde_json::from_slice(bytes) {
        Ok(o) => Some(Arc::new(o)),
        Err(e) => {
            tracing::error!(error = %e, kind = std::any::type_name::<C>(), "a compact cache's object does not decode");
            None
        }
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
    pub(crate) compact: bool,
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
            compact: false,
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

    /// Keeps each cached object encoded (its JSON, compressed against a sibling's) and decodes
    /// it on every read: a thirtieth of the memory of a decoded Deployment, a quarter of a
    /// Pod's metadata, for a few microseconds a read. For caches the plans read an object or
    /// an index at a time ([`Cache::get`], [`Cache::indexed`]); [`Cache::all`] and
    /// [`Cache::filter`] decode every object. On the primary watch ([`crate::Reconciler::primary`])
    /// each reconcile decodes its object once.
    pub fn compact(mut self) -> Self {
        self.compact = true;
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
pub(crate) fn keep_applied<C: Resource + Serialize + DeserializeOwned>(obj: &mut C, manager: &str) {
    // The managed fields are read apart from the object, so that serialising it does not copy
    // them into the tree it is projected from.
    let entries = obj.meta_mut().managed_fields.take();
    let applied: Vec<&serde_json::Value> = entries
        .iter()
        .flatten()
        .filter(|e| {
            let (by, operation) = (e.manager.as_deref(), e.operation.as_deref());
            crate::diff::is_apply_of(manager, by, operation, e.subresource.as_deref())
        })
        .filter_map(|e| e.fields_v1.as_ref().map(|f| &f.0))
        .collect();
    let projected = (!applied.is_empty())
        .then(|| serde_json::to_value(&*obj).ok())
        .flatten()
        .and_then(|value| crate::diff::applied_fields(&value, applied))
        .and_then(|projected| serde_json::from_value(projected).ok());
    match projected {
        Some(trimmed) => *obj = trimmed,
        None => obj.meta_mut().managed_fields = entries,
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

    #[test]
    fn a_compact_cache_answers_as_a_decoded_one() {
        let objects = || [pod("a", "m1"), pod("b", "m1.m2")];
        let typed = Cache::from_objects(&Watch::all().index("owner", owners), objects());
        let compact = Cache::from_objects(&Watch::all().index("owner", owners).compact(), objects());
        assert!(
            matches!(compact.storage, Storage::Compact(_)),
            "nothing decoded is kept"
        );
        assert_eq!(compact.len(), typed.len());
        assert_eq!(compact.get("ns", "a"), typed.get("ns", "a"));
        assert_eq!(compact.get("other", "a"), None);
        let names = |c: &Cache<Pod>| {
            let mut n: Vec<String> = c.indexed("owner", "m1").iter().map(|p| p.name_any()).collect();
            n.sort();
            n
        };
        assert_eq!(names(&compact), ["a", "b"]);
        assert_eq!(compact.filter(|p| p.name_any() == "b").len(), 1);
        let (objects, bytes) = compact.measure();
        assert_eq!(objects, 2);
        let json: Vec<usize> = typed
            .all()
            .iter()
            .map(|p| serde_json::to_vec(&**p).unwrap().len())
            .collect();
        let (largest, all) = (json.iter().max().copied().unwrap_or(0), json.iter().sum());
        // The dictionary (one object's JSON) is counted; the second object costs less than its JSON.
        assert!(
            largest < bytes && bytes < all,
            "{bytes} counted for {json:?} bytes of JSON"
        );
    }

    #[test]
    fn a_compact_cache_follows_applies_deletes_and_swaps_in_a_relist_when_complete() {
        let (cache, mut writer) = Cache::<Pod>::empty(true);
        let names = |c: &Cache<Pod>| {
            let mut n: Vec<String> = c.all().iter().map(|p| p.name_any()).collect();
            n.sort();
            n
        };
        writer.apply(&watcher::Event::Apply(pod("a", "m1")));
        writer.apply(&watcher::Event::Apply(pod("b", "m1")));
        writer.apply(&watcher::Event::Apply(pod("b", "m2")));
        assert_eq!(
            cache.get("ns", "b").map(|p| owners(&p)),
            Some(vec!["m2".to_string()])
        );
        writer.apply(&watcher::Event::Delete(pod("a", "m1")));
        assert_eq!(names(&cache), ["b"]);
        writer.apply(&watcher::Event::Init);
        writer.apply(&watcher::Event::InitApply(pod("c", "m1")));
        assert_eq!(
            names(&cache),
            ["b"],
            "the old contents answer until the list is complete"
        );
        writer.apply(&watcher::Event::InitDone);
        assert_eq!(names(&cache), ["c"]);
    }

    #[test]
    fn a_compact_cache_stores_siblings_against_one_of_them_and_chooses_again_when_it_relists() {
        let (cache, mut writer) = Cache::<Pod>::empty(true);
        let big = |name: &str, owner: &str| {
            let mut p = pod(name, owner);
            p.metadata.annotations = Some([("note".to_string(), format!("{owner}-").repeat(50))].into());
            p
        };
        let json = |p: &Pod| serde_json::to_vec(p).unwrap().len();
        let stored = |c: &Cache<Pod>| c.measure().1;
        let dict = |c: &Cache<Pod>| match &c.storage {
            Storage::Compact(m) => m.read().unwrap().dict.to_vec(),
            Storage::Typed(_) => unreachable!("a compact cache"),
        };
        writer.apply(&watcher::Event::Apply(big("a", "m1")));
        let first = stored(&cache);
        writer.apply(&watcher::Event::Apply(big("b", "m1")));
        let sibling = stored(&cache) - first;
        assert!(
            sibling * 5 < json(&big("b", "m1")),
            "a sibling takes {sibling} bytes for {} of JSON",
            json(&big("b", "m1"))
        );
        // A relist fills a new map, with a dictionary of its own, and replaces both at once.
        writer.apply(&watcher::Event::Init);
        writer.apply(&watcher::Event::InitApply(big("c", "m2")));
        writer.apply(&watcher::Event::InitApply(big("d", "m2")));
        assert_eq!(cache.get("ns", "a"), Some(Arc::new(big("a", "m1"))));
        writer.apply(&watcher::Event::InitDone);
        assert_eq!(cache.get("ns", "a"), None);
        assert_eq!(cache.get("ns", "d"), Some(Arc::new(big("d", "m2"))));
        assert_eq!(dict(&cache), serde_json::to_vec(&big("c", "m2")).unwrap());
        // Emptied, the map takes the next object as its dictionary.
        writer.apply(&watcher::Event::Delete(big("c", "m2")));
        writer.apply(&watcher::Event::Delete(big("d", "m2")));
        writer.apply(&watcher::Event::Apply(big("e", "m3")));
        writer.apply(&watcher::Event::Apply(big("f", "m3")));
        let mut names: Vec<String> = cache.all().iter().map(|p| p.name_any()).collect();
        names.sort();
        assert_eq!(names, ["e", "f"]);
        assert_eq!(cache.get("ns", "f"), Some(Arc::new(big("f", "m3"))));
        assert_eq!(dict(&cache), serde_json::to_vec(&big("e", "m3")).unwrap());
    }

    #[test]
    fn an_index_hands_back_references_with_the_namespace_only_of_namespaced_objects() {
        use k8s_openapi::api::core::v1::Namespace;
        let i = Index::new(Arc::new(|n: &Namespace| vec![n.name_any()]));
        let mut ns = Namespace::default();
        ns.metadata.name = Some("team-a".into());
        i.observe(&watcher::Event::Apply(ns));
        let r = i.refs("team-a");
        assert_eq!(r, [ObjectRef::new("team-a")]);
        assert_eq!(r[0].namespace, None);
        let p = Index::new(Arc::new(owners));
        p.observe(&watcher::Event::Apply(pod("a", "m1")));
        assert_eq!(p.refs("m1")[0].namespace.as_deref(), Some("ns"));
    }

    #[test]
    fn a_typed_object_keeps_what_its_manager_applied_as_its_json_would() {
        use k8s_openapi::api::apps::v1::Deployment;
        let json = serde_json::json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "m", "namespace": "ns", "uid": "u", "resourceVersion": "9",
                "labels": {"app": "memcached", "other": "x"},
                "managedFields": [
                    {"manager": "opkit-memcached", "operation": "Apply", "fieldsType": "FieldsV1",
                     "fieldsV1": {"f:metadata": {"f:labels": {"f:app": {}}}, "f:spec": {"f:replicas": {}}}},
                    {"manager": "kubectl-edit", "operation": "Update", "fieldsType": "FieldsV1",
                     "fieldsV1": {"f:metadata": {"f:labels": {"f:other": {}}}}},
                    {"manager": "opkit-memcached", "operation": "Apply", "subresource": "status",
                     "fieldsType": "FieldsV1", "fieldsV1": {"f:spec": {"f:progressDeadlineSeconds": {}}}}
                ]},
            "spec": {"replicas": 2, "progressDeadlineSeconds": 600,
                "selector": {"matchLabels": {"app": "memcached"}}, "template": {}},
            "status": {"replicas": 2}
        });
        let whole: Deployment = serde_json::from_value(json.clone()).unwrap();
        let mut d = whole.clone();
        keep_applied(&mut d, "opkit-memcached");
        let projected = crate::diff::applied_by(&serde_json::to_value(&whole).unwrap(), "opkit-memcached");
        let expected: Deployment = serde_json::from_value(projected.unwrap()).unwrap();
        assert_eq!(d, expected);
        assert_eq!(d.spec.as_ref().map(|s| s.replicas), Some(Some(2)));
        assert_eq!(d.spec.as_ref().and_then(|s| s.progress_deadline_seconds), None);
        assert_eq!(d.labels().get("other"), None);
        // Nothing applied by this manager: the object stays whole, managed fields and all.
        let mut untouched = whole.clone();
        keep_applied(&mut untouched, "someone-else");
        assert_eq!(untouched, whole);
    }
}
