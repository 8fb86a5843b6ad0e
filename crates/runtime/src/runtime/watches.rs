//! How declared watches become running reflectors: each fills a [`Cache`] (and its indexes),
//! counts towards the controller's sync gate, and triggers reconciles — except for changes
//! its filter ignores and for the echoes of opkit's own writes.
use std::collections::HashMap;
use std::fmt::Debug;

use crate::changed::hash;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::{FutureExt, Stream, StreamExt};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use prometheus_client::metrics::counter::Counter;
use serde::de::DeserializeOwned;

use super::admission::Admission;
use super::queue::{Controller, Queue};
use super::resync::{Resync, settled};
use super::shared::{Echoes, ShareKey, Shared, SharedWatches, Subscribers, Synced, queue_key};
use super::status::not_older;
use crate::OWNER_LABEL;
use crate::cache::{Cache, Filter, KeyFn, OWNER_INDEX, Watch, observe_all};
use crate::kind::{KindScope, Watchable, api, namespaced};
use crate::outside::{Outside, OutsideCache};
use crate::plan::Deletion;
use crate::runtime::context::Shard;

mod dynamic;
mod listed;

/// How long after an act changed an outside thing its objects are reconciled.
pub(crate) const ACTED: Duration = Duration::from_millis(250);

/// The index of the primary cache by uid, so that [`OWNER_LABEL`] leads back to its owner.
const UID_INDEX: &str = "opkit.dev/uid";

/// Decides per watch event whether it triggers a reconcile: not an echo, and (with a filter)
/// a change of what the filter hashes. Deletions always trigger. `kind` names the objects'
/// kind as opkit's writes record it (none yet: nothing can be an echo).
fn triggers<C: Resource>(
    filter: Option<Filter<C>>,
    echoes: Echoes,
    kind: impl Fn() -> Option<String>,
) -> impl FnMut(&Result<watcher::Event<C>, watcher::Error>) -> futures::future::Ready<bool> {
    let mut seen: HashMap<(Option<String>, String), u64> = HashMap::new();
    let key = |o: &C| (o.namespace(), o.name_any());
    move |ev| {
        let keep = match ev {
            Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) => {
                let echo = kind().is_some_and(|k| echoes.is_echo(&k, o));
                let changed = match &filter {
                    None => true,
                    Some(f) => {
                        let h = hash(&(o.uid(), f(o)));
                        seen.insert(key(o), h) != Some(h)
                    }
                };
                !echo && changed
            }
            Ok(watcher::Event::Delete(o)) => {
                seen.remove(&key(o));
                true
            }
            _ => true,
        };
        futures::future::ready(keep)
    }
}

/// The kind of `C`, for [`triggers`].
fn kind_of<C: Resource<DynamicType = ()>>() -> impl Fn() -> Option<String> {
    || Some(C::kind(&()).to_string())
}

/// Lists the cached children controlled by the object of a uid: what pruning may delete (by
/// name, as it always has: no uid precondition).
pub(crate) type Pruner = Box<dyn Fn(&str) -> Vec<Deletion> + Send + Sync>;

/// The uids of the primary objects that control `obj`: its controller owner reference and
/// its [`OWNER_LABEL`].
fn owner_uids<C: Resource>(obj: &C) -> Vec<String> {
    let mut uids: Vec<String> = obj
        .owner_references()
        .iter()
        .filter(|o| o.controller == Some(true))
        .map(|o| o.uid.clone())
        .collect();
    if let Some(uid) = obj.labels().get(OWNER_LABEL)
        && !uids.contains(uid)
    {
        uids.push(uid.clone());
    }
    uids
}

/// What a [`crate::Reconciler`] declares its watches on, once per watched namespace (once in all
/// for a cluster-scoped primary kind).
pub struct Watches<K>
where
    K: Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned + Send + Sync + 'static,
{
    client: Client,
    namespace: Option<String>,
    pub(crate) controller: Option<Controller<K>>,
    primary: Cache<K>,
    synced: Synced,
    pub(crate) pruners: Vec<Pruner>,
    pub(crate) adopters: Vec<Adopter>,
    pub(crate) background: Vec<BoxFuture<'static, ()>>,
    metrics: crate::metrics::ControllerMetrics,
    field_manager: String,
    echoes: Echoes,
    shared: SharedWatches,
    enqueue: Enqueue<K>,
    /// The listed objects whose reconcile waits behind new work.
    pub(crate) resync: Arc<Resync<K>>,
    /// The fair line every other request waits in.
    pub(crate) admission: Arc<Admission<K>>,
    /// The primary objects' requests, waiting or running.
    pub(crate) queue: Arc<Queue>,
    /// The outside sources declared, which carry out the plans' acts.
    pub(crate) actors: crate::outside::Actors,
}

/// Tells the controller's work-queue metrics that a reconcile of an object was asked for
/// (only while this replica leads: a standby's reconciles wait for the Lease, not in a queue).
#[derive(Clone)]
struct Enqueue<K: Resource<DynamicType = ()> + Clone + 'static> {
    queue: crate::metrics::Queue,
    ctx: crate::runtime::context::ControllerContext,
    primary: Cache<K>,
}

impl<K: Resource<DynamicType = ()> + Clone + Send + Sync + 'static> Enqueue<K> {
    fn add(&self, r: &ObjectRef<K>) {
        let key = queue_key(r.namespace.as_deref(), &r.name);
        if !self.ctx.is_leading() || self.queue.is_pending(&key) {
            return;
        }
        let (primary, r2) = (self.primary.clone(), r.clone());
        let exists: crate::metrics::Exists = Box::new(move || primary.contains(&r2));
        if exists() {
            self.queue.add(key, exists);
        }
    }
}

impl<K> Watches<K>
where
    K: Watchable,
{
    /// The primary watch (`watch`, from [`crate::Reconciler::primary`]) in `namespace`, ready
    /// for the reconciler's own.
    pub(crate) fn new(
        mut watch: Watch<K>,
        ctx: &crate::runtime::context::ControllerContext,
        namespace: Option<String>,
        synced: Synced,
        concurrency: u16,
    ) -> Self {
        let mut w = Watches {
            client: ctx.client().clone(),
            namespace,
            controller: None,
            primary: Cache::empty(false).0,
            synced,
            pruners: Vec::new(),
            adopters: Vec::new(),
            background: Vec::new(),
            metrics: ctx.metrics().clone(),
            field_manager: ctx.field_manager().to_string(),
            echoes: ctx.echoes().clone(),
            shared: ctx.shared().clone(),
            enqueue: Enqueue {
                queue: ctx.metrics().queue(),
                ctx: ctx.clone(),
                primary: Cache::empty(false).0,
            },
            resync: Resync::new(concurrency, ctx.metrics().resync_gauge()),
            queue: Queue::new(),
            admission: Admission::new(0, false, None, Cache::empty(false).0, true),
            actors: Default::default(),
        };
        // A controller of a kind that is not there has nothing to do: it waits for it.
        watch.optional = false;
        if let Some(shard) = ctx.shard() {
            // A member watches, caches and reconciles only the objects placed on it.
            watch.labels = Some(mine(watch.labels.take(), shard));
        }
        let (primary, events) = w.subscribe(&watch);
        primary.add_index(UID_INDEX, Arc::new(|o: &K| o.uid().into_iter().collect()));
        w.enqueue.primary = primary.clone();
        w.admission = Admission::new(
            concurrency,
            ctx.tuning().fair_queue,
            watch.fair_by.take(),
            primary.clone(),
            namespaced::<K>(),
        );
        let enqueue = w.enqueue.clone();
        let resync = w.resync.clone();
        // What the sharder asks of an object (take its children over, give it back) is work.
        let asked = ctx.shard().map(|s| (s.adopt.clone(), s.drain.clone()));
        let asked = move |o: &K| {
            asked.as_ref().is_some_and(|(adopt, drain)| {
                o.annotations().contains_key(adopt) || o.labels().contains_key(drain)
            })
        };
        let listing = w.admission.clone();
        let queue = w.queue.clone();
        let stream = events
            .inspect(w.synced.track())
            // A deleted object's request goes with it (one deleted while the watch was down
            // goes when its request falls due and finds it gone); a list waits to be swapped in.
            .inspect(move |ev| queue.follow(ev))
            // The cache holds the object now: opkit's status writes it shows are done.
            .inspect(super::status::follow(ctx.status_writes().clone()))
            .inspect(move |ev| listing.follow(ev))
            .filter(triggers(watch.filter, w.echoes.clone(), kind_of::<K>()))
            .filter(move |ev| {
                // A listed object that has seen its generation waits behind new work.
                let later = match ev {
                    Ok(watcher::Event::InitApply(o)) if settled(o) && !asked(o) => {
                        resync.defer(ObjectRef::from_obj(o));
                        true
                    }
                    _ => false,
                };
                futures::future::ready(!later)
            })
            .applied_objects()
            .inspect(move |o| {
                if let Ok(o) = o {
                    enqueue.add(&ObjectRef::from_obj(o));
                }
            })
            .filter_map({
                let (admission, ctx) = (w.admission.clone(), ctx.clone());
                move |o| {
                    // A failed watch is logged and retried where it runs.
                    futures::future::ready(
                        o.ok()
                            .and_then(|o| admission.admit(ObjectRef::from_obj(&o), ctx.is_leading())),
                    )
                }
            });
        let resync = w
            .resync
            .clone()
            .feed(ctx.clone(), w.synced.subscribe(), primary.clone());
        w.controller = Some(
            Controller::new(primary.clone(), w.queue.clone(), concurrency)
                .with_metrics(w.enqueue.queue.clone())
                .ready_on({
                    let mut synced = w.synced.subscribe();
                    async move {
                        let _ = synced.wait_for(|s| *s).await;
                    }
                })
                .reconcile_on(stream)
                .reconcile_on(resync)
                .reconcile_on(w.admission.clone().feed({
                    let ctx = ctx.clone();
                    move || ctx.is_leading()
                })),
        );
        w.primary = primary;
        w
    }

    /// The cache of the primary kind (e.g. to map a watched object to the primaries that
    /// refer to it, with an index from [`Watches::index_primary`]).
    pub fn primary(&self) -> Cache<K> {
        self.primary.clone()
    }

    /// Adds an index to the primary cache, typically for a mapper: "which primaries refer to
    /// this ConfigMap" without scanning them all.
    pub fn index_primary<I>(&mut self, name: &'static str, key: impl Fn(&K) -> I + Send + Sync + 'static)
    where
        I: IntoIterator<Item = String>,
    {
        self.primary
            .add_index(name, Arc::new(move |k: &K| key(k).into_iter().collect()));
    }

    /// The cache `w` describes, and this controller's feed of its watch events: shared with
    /// every controller of the manager that declared the same kind, namespace, selector and
    /// projection, so that one watch and one store serve them all.
    fn subscribe<C: Watchable>(
        &mut self,
        w: &Watch<C>,
    ) -> (
        Cache<C>,
        impl Stream<Item = Result<watcher::Event<C>, watcher::Error>> + Send + use<K, C>,
    ) {
        let applied = w.applied.as_ref().map(|_| self.field_manager.clone());
        let key = ShareKey {
            kind: std::any::TypeId::of::<C>(),
            namespace: self.namespace.clone().filter(|_| namespaced::<C>()),
            labels: w.labels.clone(),
            fields: w.fields.clone(),
            trim: w.trim.as_ref().map(|t| t.key),
            applied: applied.clone(),
            optional: w.optional,
            compact: w.compact,
        };
        let (tx, rx) = futures::channel::mpsc::unbounded();
        let mut shared = self.shared.inner.lock().unwrap_or_else(|p| p.into_inner());
        let (cache, active) = match shared
            .entries
            .get(&key)
            .and_then(|e| e.downcast_ref::<Shared<C>>())
        {
            Some(existing) => {
                existing
                    .subscribers
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .join(tx, &existing.cache);
                (existing.cache.clone(), existing.active.clone())
            }
            None => {
                let mut cfg = watcher::Config::default();
                if let Some(l) = &w.labels {
                    cfg = cfg.labels(l);
                }
                if let Some(f) = &w.fields {
                    cfg = cfg.fields(f);
                }
                let trim = w.trim.clone();
                let (cache, mut writer) = Cache::empty(w.compact);
                let subscribers = Arc::new(Mutex::new(Subscribers::new(tx)));
                let (indexes, subs, listed) = (cache.indexes().clone(), subscribers.clone(), cache.clone());
                let kind = C::kind(&()).to_string();
                let (client, namespace) = (self.client.clone(), self.namespace.clone());
                let (manager, held) = (applied.clone(), cache.clone());
                let undecodable = self.metrics.undecodable(&kind);
                let counted = undecodable.clone();
                let connect = move || {
                    let applied = manager.clone().map(|m| (m, held.clone(), counted.clone()));
                    events_of::<C>(&client, namespace.as_deref(), cfg.clone(), applied)
                };
                let active = w.optional.then(|| Arc::new(AtomicBool::new(false)));
                let events = match &active {
                    Some(active) => {
                        let cached = cache.clone();
                        optional(connect, move || cached.all(), active.clone(), kind.clone(), false).boxed()
                    }
                    None => connect().default_backoff().boxed(),
                };
                // When the first list of a served kind is complete, say how long it took since
                // the watch began to run: what a start waits for. An optional watch's "not served,
                // empty" is not that list.
                let serving = active.clone();
                let driver = async move {
                    let (started, mut synced) = (Instant::now(), false);
                    let events = events.modify(move |o| {
                        o.managed_fields_mut().clear();
                        if let Some(t) = &trim {
                            (t.apply)(o);
                        }
                    });
                    let mut events = std::pin::pin!(events);
                    while let Some(ev) = events.next().await {
                        let ev = match ev {
                            Ok(ev) => ev,
                            // A watch goes on past the object (a paged list fails whole and is
                            // listed again); kube's error does not name the object.
                            Err(e) if undecodable_object(&e) => {
                                undecodable.inc();
                                tracing::error!(kind, error = %e, "a watched object does not decode");
                                continue;
                            }
                            Err(e) => {
                                tracing::warn!(kind, error = %e, "watch failed; retrying with backoff");
                                continue;
                            }
                        };
                        writer.apply(&ev);
                        // The indexes are complete before any subscriber counts the watch as
                        // synced.
                        observe_all(&indexes, &ev);
                        let served = || serving.as_ref().is_none_or(|a| a.load(Ordering::SeqCst));
                        if !synced && matches!(ev, watcher::Event::InitDone) && served() {
                            synced = true;
                            let seconds = started.elapsed().as_secs_f64();
                            tracing::info!(kind, objects = listed.len(), seconds, "cache synced");
                        }
                        subs.lock().unwrap_or_else(|p| p.into_inner()).send(ev, &listed);
                    }
                }
                .boxed();
                // Reported under the controller that declared it first.
                let measured = cache.clone();
                self.metrics.cache(&C::kind(&()), move || measured.measure());
                shared.drivers.push(driver);
                shared.entries.insert(
                    key,
                    Box::new(Shared {
                        cache: cache.clone(),
                        active: active.clone(),
                        subscribers,
                    }),
                );
                (cache, active)
            }
        };
        drop(shared);
        if let Some(active) = active {
            self.metrics.optional_watch(&C::kind(&()), active);
        }
        for (name, key) in &w.indexes {
            cache.add_index(name, key.clone());
        }
        (cache, rx.map(Ok))
    }

    fn reflect<C>(
        &mut self,
        w: Watch<C>,
    ) -> (
        Cache<C>,
        impl Stream<Item = Result<watcher::Event<C>, watcher::Error>> + Send + use<K, C>,
    )
    where
        C: Watchable,
    {
        let (cache, events) = self.subscribe(&w);
        if w.prune {
            cache.add_index(OWNER_INDEX, Arc::new(owner_uids::<C>) as KeyFn<C>);
            self.add_pruner(&cache);
        }
        let stream = events.inspect(self.synced.track()).filter(triggers(
            w.filter,
            self.echoes.clone(),
            kind_of::<C>(),
        ));
        (cache, stream)
    }

    fn add_pruner<C: Watchable>(&mut self, cache: &Cache<C>) {
        let cache = cache.clone();
        self.pruners.push(Box::new(move |uid: &str| {
            cache
                .indexed(OWNER_INDEX, uid)
                .iter()
                // With its uid: an object recreated under that name since is not this one.
                .map(|c| Deletion::of(c.as_ref()))
                .collect()
        }));
    }

    /// Watches a kind the primary objects control (controller owner reference, or
    /// [`OWNER_LABEL`]): a change to one reconciles its owner. A sharded controller caches
    /// only the children of its own objects (they carry their owner's shard label).
    pub fn owns<C>(&mut self, mut w: Watch<C>) -> Cache<C>
    where
        C: Watchable,
    {
        let shard = self.enqueue.ctx.shard().cloned();
        if let Some(shard) = &shard {
            w.labels = Some(mine(w.labels.take(), shard));
        }
        let (cache, stream) = self.reflect(w);
        if let Some(shard) = shard {
            let (cache, ctx) = (cache.clone(), self.enqueue.ctx.clone());
            let namespace = self.namespace.clone().filter(|_| namespaced::<C>());
            self.adopters.push(Box::new(move |uid: String| {
                let (cache, ctx, shard, namespace) =
                    (cache.clone(), ctx.clone(), shard.clone(), namespace.clone());
                async move { adopt(&cache, &ctx, &shard, namespace.as_deref(), &uid).await }.boxed()
            }));
        }
        let primary = self.primary.clone();
        let owners = move |c: C| {
            let ns = c.namespace().filter(|_| namespaced::<K>());
            let mut refs: Vec<ObjectRef<K>> = c
                .owner_references()
                .iter()
                .filter(|o| {
                    o.controller == Some(true)
                        && o.kind == K::kind(&())
                        && o.api_version == K::api_version(&())
                })
                .map(|o| {
                    let r = ObjectRef::new(&o.name);
                    match &ns {
                        Some(ns) => r.within(ns),
                        None => r,
                    }
                })
                .collect();
            if let Some(uid) = c.labels().get(OWNER_LABEL) {
                for r in primary.indexed_refs(UID_INDEX, uid) {
                    if !refs.contains(&r) {
                        refs.push(r);
                    }
                }
            }
            refs
        };
        self.trigger(stream, owners);
        cache
    }

    /// Wires a related kind's events to the primaries `refs` names (counted as queued). What a
    /// list brings (the operator starting, a watch listing again) only puts those primaries
    /// into the resync: listed unchanged, a child says nothing new of its owner. They go in
    /// once the list is complete, when the cache holds it: a primary reconciled earlier would
    /// see the cache as it was before the list (empty, for a kind installed a moment ago).
    fn trigger<C: Resource + Clone + Send + Sync + 'static>(
        &mut self,
        events: impl Stream<Item = Result<watcher::Event<C>, watcher::Error>> + Send + 'static,
        refs: impl Fn(C) -> Vec<ObjectRef<K>> + Send + Sync + 'static,
    ) {
        let refs = Arc::new(refs);
        let (listed, resync) = (refs.clone(), self.resync.clone());
        let mut pending = Vec::new();
        let stream = events
            .filter_map(move |ev| {
                let ev = match ev {
                    Ok(watcher::Event::Init) => {
                        pending.clear();
                        None
                    }
                    Ok(watcher::Event::InitApply(c)) => {
                        pending.extend(listed(c));
                        None
                    }
                    Ok(watcher::Event::InitDone) => {
                        pending.drain(..).for_each(|r| resync.defer(r));
                        None
                    }
                    ev => Some(ev),
                };
                futures::future::ready(ev)
            })
            .touched_objects();
        let enqueue = self.enqueue.clone();
        let refs = stream.flat_map(move |c| {
            // A failed watch is logged and retried where it runs.
            let refs = c.map(|c| refs(c)).unwrap_or_default();
            refs.iter().for_each(|r| enqueue.add(r));
            futures::stream::iter(refs)
        });
        let refs = self.admitted(refs);
        self.controller = self.controller.take().map(|c| c.reconcile_on(refs));
    }

    /// `refs` through the fair line: those that go on now.
    fn admitted(
        &self,
        refs: impl Stream<Item = ObjectRef<K>> + Send + 'static,
    ) -> impl Stream<Item = ObjectRef<K>> + Send + 'static {
        let (admission, ctx) = (self.admission.clone(), self.enqueue.ctx.clone());
        refs.filter_map(move |r| futures::future::ready(admission.admit(r, ctx.is_leading())))
    }

    /// Watches a related kind: a change to one reconciles the primary objects `map` names.
    pub fn watches<C, I>(&mut self, w: Watch<C>, map: impl Fn(C) -> I + Send + Sync + 'static) -> Cache<C>
    where
        C: Watchable,
        I: IntoIterator<Item = ObjectRef<K>> + 'static,
        I::IntoIter: Send,
    {
        let (cache, stream) = self.reflect(w);
        self.trigger(stream, move |c: C| map(c).into_iter().collect());
        cache
    }

    /// Reconciles what `trigger` asks for: objects of the primary kind named from outside the
    /// cluster (a file that changed, an HTTP callback), or all of them.
    pub fn triggered_by(&mut self, trigger: &crate::trigger::Trigger<K>) {
        let namespace = self.namespace.clone().filter(|_| namespaced::<K>());
        let (one, all) = trigger.subscribe(namespace);
        let enqueue = self.enqueue.clone();
        let one = self.admitted(one.inspect(move |r| enqueue.add(r)));
        self.controller = self
            .controller
            .take()
            .map(|c| c.reconcile_on(one).reconcile_all_on(all));
    }

    /// Declares things outside the cluster that the plans read and change ([`Outside`]):
    /// `source` is read in full every `every` (and each thing again right after an act on
    /// it) into the returned cache; a thing that appeared, changed or went reconciles the
    /// objects `map` names, so drift made by hand is put right within a poll. Reconciles
    /// start once the first read has finished, well or not; while the source cannot be read,
    /// the cache's lookups say so ([`OutsideCache::get`]).
    pub fn outside<O, I>(
        &mut self,
        source: O,
        every: Duration,
        map: impl Fn(&O::Key) -> I + Send + Sync + 'static,
    ) -> OutsideCache<O>
    where
        O: Outside,
        I: IntoIterator<Item = ObjectRef<K>>,
    {
        assert!(
            !self.actors.contains_key(&std::any::TypeId::of::<O>()),
            "{} declares the outside source {} twice: acts name their source by type, so each type may be declared once",
            std::any::type_name::<K>(),
            std::any::type_name::<O>(),
        );
        let (tx, rx) = futures::channel::mpsc::unbounded();
        let map = Arc::new(map);
        let send = {
            let (tx, map) = (tx.clone(), map.clone());
            move |key: &O::Key| {
                for r in map(key) {
                    let _ = tx.unbounded_send(r);
                }
            }
        };
        // A thing an act changed reconciles its objects, after a pause: two objects that
        // fight over one thing take turns at that pace, not in a hot loop.
        let notify = {
            let send = Arc::new(send.clone());
            move |key: &O::Key| {
                let (send, key) = (send.clone(), key.clone());
                tokio::spawn(async move {
                    tokio::time::sleep(ACTED).await;
                    send(&key);
                });
            }
        };
        let cache = OutsideCache::new(source).notifying(notify);
        self.actors
            .insert(std::any::TypeId::of::<O>(), Arc::new(cache.clone()));
        let enqueue = self.enqueue.clone();
        let rx = self.admitted(rx.inspect(move |r| enqueue.add(r)));
        self.controller = self.controller.take().map(|c| c.reconcile_on(rx));
        let read_once = self.synced.track_once();
        let poller = cache.clone();
        let every = every.max(Duration::from_millis(100));
        self.background.push(
            async move {
                poller.poll().await;
                read_once();
                poller.keep_read(every, || tx.is_closed(), send).await;
            }
            .boxed(),
        );
        cache
    }

    /// Caches a kind without triggering anything on its changes.
    pub fn reads<C>(&mut self, w: Watch<C>) -> Cache<C>
    where
        C: Watchable,
    {
        let (cache, stream) = self.reflect(w);
        self.background
            .push(stream.for_each(|_| futures::future::ready(())).boxed());
        cache
    }
}

/// How long an optional watch waits before it asks again whether its kind is served: soon
/// after the kind went, then every few seconds.
const MISSING_FIRST: Duration = Duration::from_millis(500);
const MISSING_MAX: Duration = Duration::from_secs(5);
/// The backoff of an optional watch's other errors, as kube's default one.
const FAILED_FIRST: Duration = Duration::from_millis(800);
const FAILED_MAX: Duration = Duration::from_secs(30);

/// Whether a watch error says that the kind is not served (its CRD is not installed): a list
/// or a watch refused with 404. Errors in a running watch say nothing of the kind.
fn missing(e: &watcher::Error) -> bool {
    match e {
        watcher::Error::InitialListFailed(kube::Error::Api(s))
        | watcher::Error::WatchStartFailed(kube::Error::Api(s)) => s.code == 404,
        _ => false,
    }
}

/// The events of a watch of `api` whose first list is streamed (a watch with
/// `sendInitialEvents`): the client decodes objects while the server still sends them, where
/// pages in a row would add the server's time and the client's, page after page. A server
/// that refuses streaming (before 1.27, or with `WatchList` off) gets its lists in pages, from
/// then on for this watch.
pub(crate) fn streamed<C>(
    api: kube::Api<C>,
    cfg: watcher::Config,
) -> BoxStream<'static, watcher::Result<watcher::Event<C>>>
where
    C: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    let events = watcher(api.clone(), cfg.clone().streaming_lists()).boxed();
    futures::stream::unfold((events, Some((api, cfg))), |(mut events, mut paged)| async move {
        loop {
            match events.next().await? {
                Err(watcher::Error::WatchStartFailed(kube::Error::Api(s)))
                    if paged.is_some() && refuses_streaming(&s) =>
                {
                    let (api, cfg) = paged.take()?;
                    tracing::info!(
                        resource = api.resource_url(),
                        reason = %s.message,
                        "the API server does not stream lists: listing in pages"
                    );
                    events = watcher(api, cfg).boxed();
                }
                ev => return Some((ev, (events, paged))),
            }
        }
    })
    .boxed()
}

/// The events of a watch of `C`; with `applied` (the controller's field manager, the cache
/// the watch fills and the count of objects that do not decode), each object projected onto
/// what that manager applied ([`crate::Watch::applied`]) straight from its decoded JSON.
fn events_of<C: Watchable>(
    client: &Client,
    namespace: Option<&str>,
    cfg: watcher::Config,
    applied: Option<(String, Cache<C>, Counter)>,
) -> BoxStream<'static, watcher::Result<watcher::Event<C>>> {
    let Some((manager, cache, undecodable)) = applied else {
        return streamed(api::<C>(client, namespace), cfg);
    };
    let api = <C::Scope as KindScope>::api::<listed::Listed<C>>(client.clone(), namespace);
    streamed(api, cfg)
        .filter_map(move |ev| {
            let ev = match ev {
                Ok(ev) => listed::projected(ev, &manager, &cache, &undecodable).map(Ok),
                Err(e) => Some(Err(e)),
            };
            futures::future::ready(ev)
        })
        .boxed()
}

/// Whether a typed watch failed on an object that does not decode as its kind: the watch goes
/// on past it, and a paged list fails whole. kube reads such a watch line as a `Status` when
/// it can (every field of one has a default), so it comes as an API error without a code,
/// which no server sends.
fn undecodable_object(e: &watcher::Error) -> bool {
    match e {
        watcher::Error::WatchFailed(kube::Error::Api(s)) => s.code == 0,
        watcher::Error::WatchFailed(kube::Error::SerdeError(_))
        | watcher::Error::InitialListFailed(kube::Error::SerdeError(_)) => true,
        _ => false,
    }
}

/// Whether a refused watch says the server cannot stream lists: 422 naming `sendInitialEvents`
/// (the `WatchList` gate off) or `resourceVersionMatch` (before 1.27, which knew neither). A bad
/// selector's 400 is no reason to list in pages.
fn refuses_streaming(s: &kube::core::Status) -> bool {
    matches!(s.code, 400 | 422)
        && (s.message.contains("sendInitialEvents") || s.message.contains("resourceVersionMatch"))
}

/// The state of an optional watch between two of its events.
struct Optional<C: Resource<DynamicType: Eq + std::hash::Hash + Clone> + Clone + 'static, F> {
    /// A new watch of the kind: the watcher, or (for a kind named at run time) discovery and
    /// then the watcher.
    connect: F,
    events: Option<BoxStream<'static, watcher::Result<watcher::Event<C>>>>,
    /// What the watch has delivered: its objects leave as deletions when the kind goes.
    cached: Box<dyn Fn() -> Vec<Arc<C>> + Send>,
    active: Arc<AtomicBool>,
    /// Whether the kind was neither found nor missed yet.
    first: bool,
    /// Whether a first error of another kind than "not served" counts as not served too
    /// (logged): for a kind named at run time, which may be one the operator may not list.
    lenient: bool,
    /// The watcher's `Init`, held back until what follows it shows the kind is served.
    held: bool,
    wait: Option<Duration>,
    missing_wait: Duration,
    failed_wait: Duration,
    kind: String,
}

/// The events of a watch of a kind that may not be served: while it is not, the watch is
/// synced and empty (its objects delivered as deletions when the kind goes) and it asks again
/// every few seconds, quietly; once it is, the events are the watcher's. kube's own backoff
/// would not grow here: the watcher starts each list with an `Init`, which resets it.
fn optional<C, F>(
    connect: F,
    cached: impl Fn() -> Vec<Arc<C>> + Send + 'static,
    active: Arc<AtomicBool>,
    kind: String,
    lenient: bool,
) -> impl Stream<Item = watcher::Result<watcher::Event<C>>> + Send + 'static
where
    C: Resource<DynamicType: Eq + std::hash::Hash + Clone> + Clone + Send + Sync + 'static,
    F: Fn() -> BoxStream<'static, watcher::Result<watcher::Event<C>>> + Send + 'static,
{
    let state = Optional {
        connect,
        events: None,
        cached: Box::new(cached),
        active,
        first: true,
        lenient,
        held: false,
        wait: None,
        missing_wait: MISSING_FIRST,
        failed_wait: FAILED_FIRST,
        kind,
    };
    futures::stream::unfold(state, |mut s| async move {
        if let Some(wait) = s.wait.take() {
            tokio::time::sleep(wait).await;
        }
        let events = match &mut s.events {
            Some(events) => events,
            None => s.events.insert((s.connect)()),
        };
        let out = match events.next().await {
            None => {
                s.events = None;
                Vec::new()
            }
            Some(Ok(watcher::Event::Init)) => {
                s.held = true;
                Vec::new()
            }
            Some(Ok(ev)) => {
                if !s.active.swap(true, Ordering::SeqCst) {
                    tracing::info!(kind = %s.kind, "the kind of an optional watch is served: watching it");
                }
                s.first = false;
                s.missing_wait = MISSING_FIRST;
                s.failed_wait = FAILED_FIRST;
                let init = std::mem::take(&mut s.held).then_some(Ok(watcher::Event::Init));
                init.into_iter().chain([Ok(ev)]).collect()
            }
            Some(Err(e)) if missing(&e) => {
                // A new watcher lists afresh: this one would retry its watch from a version
                // of a kind that is gone.
                s.events = None;
                s.held = false;
                let mut out = Vec::new();
                if s.active.swap(false, Ordering::SeqCst) || s.first {
                    tracing::info!(kind = %s.kind, "the kind of an optional watch is not served: waiting for it to be installed");
                    out.extend((s.cached)().iter().map(|o| Ok(watcher::Event::Delete((**o).clone()))));
                    // Synced, and empty.
                    out.extend([Ok(watcher::Event::Init), Ok(watcher::Event::InitDone)]);
                }
                s.first = false;
                s.wait = Some(s.missing_wait);
                s.missing_wait = (s.missing_wait * 2).min(MISSING_MAX);
                out
            }
            Some(Err(e)) => {
                // The `Init` stays held: a streamed list goes on after an object it could not
                // decode, and what it sends next still belongs to that list.
                s.wait = Some(s.failed_wait);
                s.failed_wait = (s.failed_wait * 2).min(FAILED_MAX);
                let mut out = vec![Err(e)];
                if std::mem::take(&mut s.first) && s.lenient {
                    // Synced, and empty: the rest of the controller goes on without it, and
                    // `/readyz` names the watch waiting.
                    tracing::warn!(kind = %s.kind, "the kind cannot be watched; the controller goes on without it and asks again");
                    out.extend([Ok(watcher::Event::Init), Ok(watcher::Event::InitDone)]);
                }
                out
            }
        };
        Some((futures::stream::iter(out), s))
    })
    .flatten()
}

/// `labels` (a selector) narrowed to the objects placed on this member.
fn mine(labels: Option<String>, shard: &Shard) -> String {
    let mine = format!("{}={}", shard.label, shard.member);
    match labels {
        Some(l) => format!("{l},{mine}"),
        None => mine,
    }
}

/// Takes over, for this member, the children of one kind of the object `uid`, which the
/// sharder moved here: a child still labelled for its previous owner is relabelled (on the
/// version listed), then every child is waited for in this member's cache. Without it, a child
/// missing from the cache would look absent, and one made with `create` would be made twice.
pub(crate) type Adopter = Box<dyn Fn(String) -> BoxFuture<'static, Result<(), super::Error>> + Send + Sync>;

/// How long adopted children may take to reach the cache before the reconcile fails (and is
/// retried with backoff).
const ADOPT_WAIT: Duration = Duration::from_secs(30);

async fn adopt<C: Watchable>(
    cache: &Cache<C>,
    ctx: &crate::runtime::context::ControllerContext,
    shard: &Shard,
    namespace: Option<&str>,
    uid: &str,
) -> Result<(), super::Error> {
    use super::Error;
    use kube::api::{ListParams, Patch, PatchParams};
    let kind = C::kind(&()).to_string();
    let listed = api::<C>(ctx.client(), namespace)
        .list_metadata(&ListParams::default().labels(&format!("{OWNER_LABEL}={uid}")))
        .await
        .map_err(|source| Error::Observe { source })?;
    let mut wanted = Vec::new();
    for child in listed.items {
        let (ns, name) = (child.namespace(), child.name_any());
        let mut rv = child.resource_version().unwrap_or_default();
        if child.labels().get(&shard.label) != Some(&shard.member) {
            let mut labels = serde_json::Map::new();
            labels.insert(shard.label.clone(), shard.member.clone().into());
            let body = serde_json::json!({"metadata": {"resourceVersion": rv, "labels": labels}});
            ctx.may_write("adopt")?;
            match api::<C>(ctx.client(), ns.as_deref())
                .patch_metadata(&name, &PatchParams::default(), &Patch::Merge(&body))
                .await
            {
                Ok(written) => {
                    rv = written.resource_version().unwrap_or_default();
                    ctx.echoes().record(&kind, ns.as_deref(), &name, rv.clone());
                    tracing::info!(child = %format!("{kind} {name}"), "adopted from the previous owner");
                }
                Err(kube::Error::Api(s)) if s.code == 404 => continue,
                Err(kube::Error::Api(s)) if s.code == 409 => return Err(Error::Stale),
                Err(source) => {
                    return Err(Error::Write {
                        child: format!("{kind} {name} (adopting)"),
                        source,
                    });
                }
            }
        }
        wanted.push((ns.unwrap_or_default(), name, rv));
    }
    let deadline = Instant::now() + ADOPT_WAIT;
    loop {
        let missing = wanted
            .iter()
            .filter(|(ns, name, rv)| {
                !cache
                    .get(ns, name)
                    .is_some_and(|c| not_older(c.resource_version().as_deref(), rv))
            })
            .count();
        if missing == 0 {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(Error::Adopt { kind, missing });
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn resource_versions_compare_as_integers_when_they_are() {
        assert!(not_older(Some("10"), "9"));
        assert!(not_older(Some("10"), "10"));
        assert!(!not_older(Some("9"), "10"));
        assert!(!not_older(None, "10"));
        // Not integers: only the same version will do.
        assert!(not_older(Some("a"), "a"));
        assert!(!not_older(Some("b"), "a"));
    }

    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;

    fn cm(name: &str, rv: &str, data: &str) -> ConfigMap {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "ns", "uid": format!("u-{name}"), "resourceVersion": rv},
            "data": {"k": data},
        }))
        .expect("configmap")
    }

    fn fire(
        f: &mut impl FnMut(&Result<watcher::Event<ConfigMap>, watcher::Error>) -> futures::future::Ready<bool>,
        ev: watcher::Event<ConfigMap>,
    ) -> bool {
        futures::executor::block_on(f(&Ok(ev)))
    }

    #[test]
    fn a_filter_triggers_on_changes_of_its_key_and_on_deletions_only() {
        let data: Filter<ConfigMap> = Arc::new(|c: &ConfigMap| hash(&c.data));
        let mut f = triggers(Some(data), Echoes::default(), kind_of::<ConfigMap>());
        assert!(
            fire(&mut f, watcher::Event::InitApply(cm("a", "1", "x"))),
            "first sight"
        );
        assert!(
            !fire(&mut f, watcher::Event::Apply(cm("a", "2", "x"))),
            "same data"
        );
        assert!(
            fire(&mut f, watcher::Event::Apply(cm("a", "3", "y"))),
            "changed data"
        );
        assert!(fire(&mut f, watcher::Event::Delete(cm("a", "4", "y"))), "deleted");
        assert!(
            fire(&mut f, watcher::Event::Apply(cm("a", "5", "y"))),
            "recreated"
        );
    }

    #[test]
    fn the_echo_of_an_own_write_triggers_nothing_but_later_changes_do() {
        let echoes = Echoes::default();
        let mut f = triggers(None, echoes.clone(), kind_of::<ConfigMap>());
        echoes.record("ConfigMap", Some("ns"), "a", "7".into());
        assert!(
            fire(&mut f, watcher::Event::Apply(cm("a", "6", "x"))),
            "an older version"
        );
        assert!(
            !fire(&mut f, watcher::Event::Apply(cm("a", "7", "x"))),
            "the echo"
        );
        assert!(
            fire(&mut f, watcher::Event::Apply(cm("a", "7", "x"))),
            "seen once only"
        );
        assert!(
            fire(&mut f, watcher::Event::Apply(cm("b", "7", "x"))),
            "another object"
        );
    }

    #[test]
    fn children_are_owned_by_controller_references_and_the_owner_label() {
        let mut c = cm("a", "1", "x");
        c.metadata.owner_references = Some(vec![
            k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
                controller: Some(true),
                uid: "u1".into(),
                ..Default::default()
            },
            k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
                uid: "not-the-controller".into(),
                ..Default::default()
            },
        ]);
        c.metadata.labels = Some([(OWNER_LABEL.to_string(), "u2".to_string())].into());
        assert_eq!(owner_uids(&c), ["u1", "u2"]);
    }

    #[test]
    fn only_a_refusal_of_streaming_lists_falls_back_to_pages() {
        let refused =
            |code: u16, message: &str| kube::core::Status::failure(message, "Invalid").with_code(code);
        // kube-apiserver 1.35 with WatchList off, and a server from before 1.27.
        assert!(refuses_streaming(&refused(
            422,
            "ListOptions.meta.k8s.io \"\" is invalid: sendInitialEvents: Forbidden: sendInitialEvents is forbidden for watch unless the WatchList feature gate is enabled"
        )));
        assert!(refuses_streaming(&refused(
            422,
            "resourceVersionMatch: Forbidden: resourceVersionMatch is forbidden for watch"
        )));
        assert!(!refuses_streaming(&refused(
            400,
            "unable to parse requirement: invalid label key"
        )));
        assert!(!refuses_streaming(&refused(422, "fieldSelector: Invalid value")));
    }
}
