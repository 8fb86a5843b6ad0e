//! Carries plans out: builds the watches a [`Reconciler`] declares, holds every reconcile until
//! all of its caches have synced, and turns each [`Plan`] into writes.
//!
//! kube-runtime's `Controller` waits only for the primary store, and `Store::wait_until_ready`
//! wakes just one of several concurrent waiters. So opkit never waits on a store: it watches
//! every stream it builds for the watcher's `InitDone` and keeps its own count.
use std::collections::HashSet;
use std::fmt::Debug;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use futures::future::BoxFuture;
use futures::{FutureExt, Stream, StreamExt};
use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::core::{ApiResource, DynamicObject};
use kube::runtime::controller::{Action, Config as ControllerConfig, Controller};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::{Semaphore, watch};

use crate::conditions::{self, Desired};
use crate::context::ControllerContext;
use crate::diff::is_subset;
use crate::reconciler::{Child, Invalid, Mode, Plan, Reconciler, Requeue};

/// A read-only cache of one kind in one watch scope, filled by a watch opkit runs.
///
/// Reads never block; by the time a reconcile runs, the cache has seen the watch's initial
/// list.
pub struct Cache<C: Resource<DynamicType = ()> + Clone + 'static> {
    store: Store<C>,
    index: Option<Arc<Index<C>>>,
}

impl<C: Resource<DynamicType = ()> + Clone + 'static> Clone for Cache<C> {
    fn clone(&self) -> Self {
        Cache {
            store: self.store.clone(),
            index: self.index.clone(),
        }
    }
}

/// Cached objects by a key of the controller's (e.g. the primary a Pod belongs to), kept
/// beside the store so that finding one object's children does not scan every object.
struct Index<C: Resource<DynamicType = ()>> {
    key: fn(&C) -> Option<String>,
    maps: std::sync::RwLock<IndexMaps<C>>,
}

struct IndexMaps<C: Resource<DynamicType = ()>> {
    by_key: std::collections::HashMap<String, HashSet<ObjectRef<C>>>,
    key_of: std::collections::HashMap<ObjectRef<C>, String>,
    /// Filled during a relist and swapped in when it is complete, as the store does.
    relist: Option<Box<IndexMaps<C>>>,
}

impl<C: Resource<DynamicType = ()>> Default for IndexMaps<C> {
    fn default() -> Self {
        IndexMaps {
            by_key: Default::default(),
            key_of: Default::default(),
            relist: None,
        }
    }
}

impl<C: Resource<DynamicType = ()>> IndexMaps<C> {
    fn remove(&mut self, r: &ObjectRef<C>) {
        if let Some(old) = self.key_of.remove(r)
            && let Some(set) = self.by_key.get_mut(&old)
        {
            set.remove(r);
            if set.is_empty() {
                self.by_key.remove(&old);
            }
        }
    }

    fn insert(&mut self, r: ObjectRef<C>, key: Option<String>) {
        self.remove(&r);
        if let Some(key) = key {
            self.by_key.entry(key.clone()).or_default().insert(r.clone());
            self.key_of.insert(r, key);
        }
    }
}

impl<C: Resource<DynamicType = ()> + Clone> Index<C> {
    fn observe(&self, ev: &Result<watcher::Event<C>, watcher::Error>) {
        let Ok(ev) = ev else { return };
        let mut maps = self.maps.write().unwrap_or_else(|p| p.into_inner());
        match ev {
            watcher::Event::Apply(o) => maps.insert(ObjectRef::from_obj(o), (self.key)(o)),
            watcher::Event::Delete(o) => maps.remove(&ObjectRef::from_obj(o)),
            watcher::Event::Init => maps.relist = Some(Box::default()),
            watcher::Event::InitApply(o) => {
                let key = (self.key)(o);
                if let Some(next) = maps.relist.as_mut() {
                    next.insert(ObjectRef::from_obj(o), key);
                }
            }
            watcher::Event::InitDone => {
                if let Some(next) = maps.relist.take() {
                    *maps = *next;
                }
            }
        }
    }
}

/// Objects sampled to estimate a cache's size.
const SIZE_SAMPLE: usize = 32;

impl<C: Resource<DynamicType = ()> + Clone + 'static> Cache<C> {
    /// (objects, estimated bytes): the JSON size of a sample of the cached objects, scaled to
    /// all of them. JSON is not the in-memory layout, but it moves with what is cached, so a
    /// trim or a label selector shows up in it.
    fn measure(&self) -> (usize, usize)
    where
        C: Serialize,
    {
        let all = self.store.state();
        let step = (all.len() / SIZE_SAMPLE).max(1);
        let sample: Vec<usize> = all
            .iter()
            .step_by(step)
            .take(SIZE_SAMPLE)
            .map(|o| serde_json::to_vec(o.as_ref()).map_or(0, |v| v.len()))
            .collect();
        let bytes = match sample.len() {
            0 => 0,
            k => sample.iter().sum::<usize>() * all.len() / k,
        };
        (all.len(), bytes)
    }

    /// Reports this cache in the controller's cache metrics.
    fn report(&self, metrics: &crate::metrics::ControllerMetrics)
    where
        C: Serialize + Send + Sync,
    {
        let cache = self.clone();
        metrics.cache(&C::kind(&()), move || cache.measure());
    }

    /// The cached objects whose [`Watch::index`] key is `key`, without scanning the others.
    /// Empty when the watch declared no index.
    pub fn indexed(&self, key: &str) -> Vec<Arc<C>> {
        let Some(index) = &self.index else {
            return Vec::new();
        };
        let maps = index.maps.read().unwrap_or_else(|p| p.into_inner());
        maps.by_key
            .get(key)
            .map(|refs| refs.iter().filter_map(|r| self.store.get(r)).collect())
            .unwrap_or_default()
    }

    /// The object `name` in `namespace`, if cached.
    pub fn get(&self, namespace: &str, name: &str) -> Option<Arc<C>> {
        self.store.get(&ObjectRef::new(name).within(namespace))
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

/// Which objects of kind `C` a watch caches and what it keeps of each.
pub struct Watch<C> {
    labels: Option<String>,
    trim: fn(&mut C),
    prune: bool,
    applied: bool,
    index: Option<fn(&C) -> Option<String>>,
}

impl<C> Watch<C> {
    /// Every object of the kind in scope.
    pub fn all() -> Self {
        Watch {
            labels: None,
            trim: |_| {},
            prune: false,
            applied: false,
            index: None,
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

    /// Drops what the controller never reads before the object is cached (managed fields are
    /// always dropped).
    pub fn trim(mut self, trim: fn(&mut C)) -> Self {
        self.trim = trim;
        self
    }

    /// Keeps the cached objects findable by `key` ([`Cache::indexed`]): a plan that reads
    /// the children of one primary then costs the same with ten or ten thousand primaries.
    pub fn index(mut self, key: fn(&C) -> Option<String>) -> Self {
        self.index = Some(key);
        self
    }

    /// Caches only the fields this controller applied (its `managedFields`), plus identity,
    /// owner references and status: enough for the no-op check of the children it applies,
    /// with a field another manager took over showing as drift — and a fraction of the
    /// memory of whole objects. For kinds the plan writes with [`crate::Child::apply`] and
    /// reads nothing else of but status; objects it never applied are cached whole.
    pub fn applied(mut self) -> Self {
        self.applied = true;
        self
    }

    /// Deletes cached objects controlled by the primary object that the plan no longer
    /// produces (a renamed child, a feature turned off). Only for owned kinds.
    pub fn prune(mut self) -> Self {
        self.prune = true;
        self
    }
}

/// Counts the watch streams of one controller that have not yet delivered their initial list.
#[derive(Clone)]
pub(crate) struct Synced {
    pending: Arc<AtomicUsize>,
    ready: Arc<AtomicBool>,
    tx: Arc<watch::Sender<bool>>,
}

impl Synced {
    pub(crate) fn new(ready: Arc<AtomicBool>) -> Self {
        Synced {
            pending: Arc::default(),
            ready,
            tx: Arc::new(watch::channel(false).0),
        }
    }

    /// A new stream to wait for; call the returned closure on each of its events.
    fn track<C>(
        &self,
    ) -> impl FnMut(&kube::Result<watcher::Event<C>, watcher::Error>) + Send + 'static + use<C> {
        self.pending.fetch_add(1, Ordering::SeqCst);
        let this = self.clone();
        let mut seen = false;
        move |ev| {
            if !seen && matches!(ev, Ok(watcher::Event::InitDone)) {
                seen = true;
                if this.pending.fetch_sub(1, Ordering::SeqCst) == 1 {
                    this.ready.store(true, Ordering::SeqCst);
                    this.tx.send_replace(true);
                }
            }
        }
    }

    fn subscribe(&self) -> watch::Receiver<bool> {
        self.tx.subscribe()
    }
}

/// Lists the names of cached children controlled by an object, for pruning.
type Pruner = Box<dyn Fn(&str) -> Vec<(ApiResource, String)> + Send + Sync>;

/// What a [`Reconciler`] declares its watches on, once per watched namespace.
pub struct Watches<K>
where
    K: Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned + Send + Sync + 'static,
{
    client: Client,
    namespace: Option<String>,
    controller: Option<Controller<K>>,
    primary: Cache<K>,
    synced: Synced,
    pruners: Vec<Pruner>,
    background: Vec<BoxFuture<'static, ()>>,
    metrics: crate::metrics::ControllerMetrics,
    field_manager: String,
}

/// A namespaced kind opkit can watch and cache: what every watch, cache and primary needs.
pub trait Watchable:
    Resource<DynamicType = (), Scope = NamespaceResourceScope>
    + Clone
    + Debug
    + DeserializeOwned
    + Serialize
    + Send
    + Sync
    + 'static
{
}

impl<T> Watchable for T where
    T: Resource<DynamicType = (), Scope = NamespaceResourceScope>
        + Clone
        + Debug
        + DeserializeOwned
        + Serialize
        + Send
        + Sync
        + 'static
{
}

fn api<C>(client: &Client, namespace: Option<&str>) -> Api<C>
where
    C: Resource<DynamicType = (), Scope = NamespaceResourceScope>,
{
    match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

impl<K> Watches<K>
where
    K: Watchable,
{
    /// The cache of the primary kind (e.g. to map a watched object to the primaries that
    /// refer to it).
    pub fn primary(&self) -> Cache<K> {
        self.primary.clone()
    }

    fn reflect<C>(
        &mut self,
        w: &Watch<C>,
    ) -> (
        Cache<C>,
        impl Stream<Item = Result<C, watcher::Error>> + Send + use<K, C>,
    )
    where
        C: Watchable,
    {
        let mut cfg = watcher::Config::default();
        if let Some(l) = &w.labels {
            cfg = cfg.labels(l);
        }
        let trim = w.trim;
        let applied = w.applied.then(|| self.field_manager.clone());
        let index = w.index.map(|key| {
            Arc::new(Index {
                key,
                maps: Default::default(),
            })
        });
        let observer = index.clone();
        let (store, writer) = reflector::store();
        let stream = reflector::reflector(
            writer,
            watcher(api::<C>(&self.client, self.namespace.as_deref()), cfg)
                .default_backoff()
                .modify(move |o| {
                    if let Some(manager) = &applied {
                        keep_applied(o, manager);
                    }
                    o.managed_fields_mut().clear();
                    trim(o);
                }),
        )
        // The index is complete before the watch counts as synced.
        .inspect(move |ev| {
            if let Some(i) = &observer {
                i.observe(ev);
            }
        })
        .inspect(self.synced.track())
        .touched_objects();
        let cache = Cache { store, index };
        cache.report(&self.metrics);
        (cache, stream)
    }

    fn add_pruner<C>(&mut self, cache: &Cache<C>)
    where
        C: Resource<DynamicType = ()> + Clone + Send + Sync + 'static,
    {
        let cache = cache.clone();
        self.pruners.push(Box::new(move |uid: &str| {
            cache
                .filter(|c| {
                    c.owner_references()
                        .iter()
                        .any(|o| o.controller == Some(true) && o.uid == uid)
                })
                .iter()
                .map(|c| (ApiResource::erase::<C>(&()), c.name_any()))
                .collect()
        }));
    }

    /// Watches a kind the primary objects own (controller owner reference): a change to one
    /// reconciles its owner.
    pub fn owns<C>(&mut self, w: Watch<C>) -> Cache<C>
    where
        C: Watchable,
    {
        let (cache, stream) = self.reflect(&w);
        if w.prune {
            self.add_pruner(&cache);
        }
        self.controller = self.controller.take().map(|c| c.owns_stream(stream));
        cache
    }

    /// Watches a related kind: a change to one reconciles the primary objects `map` names.
    pub fn watches<C, I>(&mut self, w: Watch<C>, map: impl Fn(C) -> I + Send + Sync + 'static) -> Cache<C>
    where
        C: Watchable,
        I: IntoIterator<Item = ObjectRef<K>> + 'static,
        I::IntoIter: Send,
    {
        let (cache, stream) = self.reflect(&w);
        self.controller = self.controller.take().map(|c| c.watches_stream(stream, map));
        cache
    }

    /// Caches a kind without triggering anything on its changes.
    pub fn reads<C>(&mut self, w: Watch<C>) -> Cache<C>
    where
        C: Watchable,
    {
        let (cache, stream) = self.reflect(&w);
        self.background
            .push(stream.for_each(|_| futures::future::ready(())).boxed());
        cache
    }
}

/// Errors of the steps opkit carries out; the category labels metrics and log lines.
#[derive(Debug, thiserror::Error)]
#[allow(missing_docs)] // every variant says what failed in its message
pub enum Error {
    #[error("observing: {source}")]
    Observe { source: kube::Error },
    #[error("writing {child}: {source}")]
    Write { child: String, source: kube::Error },
    #[error("{child} exists and is not controlled by this object")]
    Conflict { child: String },
    #[error("deleting {child}: {source}")]
    Prune { child: String, source: kube::Error },
    #[error("writing status: {source}")]
    Status { source: kube::Error },
    #[error("encoding: {0}")]
    Encode(#[from] serde_json::Error),
    #[error("not the leader (its lease may have expired): write refused")]
    NotLeader,
    #[error("the object changed since it was read; planning again from the newer version")]
    Stale,
}

impl Error {
    /// A short stable label for metrics.
    pub fn category(&self) -> &'static str {
        match self {
            Error::Observe { .. } => "observe",
            Error::Write { .. } => "apply",
            Error::Conflict { .. } => "conflict",
            Error::Prune { .. } => "delete",
            Error::Status { .. } => "status",
            Error::Encode(_) => "encode",
            Error::NotLeader => "not_leader",
            Error::Stale => "stale",
        }
    }
}

/// One watch scope (namespace) of one controller.
struct Runner<R: Reconciler> {
    reconciler: Arc<R>,
    cache: R::Cache,
    pruners: Vec<Pruner>,
    synced: watch::Receiver<bool>,
    ctx: ControllerContext,
    limit: Option<Arc<Semaphore>>,
    written: StatusWrites,
}

/// The status writes whose watch events the primary cache has not delivered yet.
///
/// Right after a status write, a reconcile triggered by a child still reads the primary as it
/// was before it. Planned from that, the status looks out of date, and its write — with the
/// stale resourceVersion as precondition — only earns a conflict and a second round. So each
/// write is remembered (per uid: the resourceVersions the write came from and produced, and a
/// hash of what it wrote) until the cache shows the last of them: a plan made from a version
/// this replica has since replaced compares against what it wrote, and writes with the
/// resourceVersion it got back. A version not in the chain means someone else wrote: the
/// entry is dropped and the cache decides, as before.
#[derive(Default)]
struct StatusWrites {
    chains: std::sync::Mutex<std::collections::HashMap<String, StatusChain>>,
}

struct StatusChain {
    /// resourceVersions, oldest first; the last is what the latest write returned.
    versions: Vec<String>,
    /// Hash of the status the latest write applied.
    status: u64,
    at: std::time::Instant,
}

/// What a status write should compare against and send as its precondition.
enum StatusBase {
    /// The cached object is current (as far as this replica knows).
    Cache,
    /// The cached object is older than this replica's own last write.
    Written { version: String, status: u64 },
}

/// Chains untouched for this long are dropped (their watch events were lost or the object is
/// gone); the next plan then trusts the cache.
const CHAIN_TTL: std::time::Duration = std::time::Duration::from_secs(120);

fn status_hash(v: &serde_json::Value) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    v.to_string().hash(&mut h);
    h.finish()
}

impl StatusWrites {
    fn base(&self, uid: &str, cached: &str) -> StatusBase {
        let mut chains = self.chains.lock().unwrap_or_else(|p| p.into_inner());
        let Some(chain) = chains.get(uid) else {
            return StatusBase::Cache;
        };
        let stale = chain.at.elapsed() > CHAIN_TTL;
        match chain.versions.iter().position(|v| v == cached) {
            Some(i) if !stale && i + 1 < chain.versions.len() => StatusBase::Written {
                version: chain.versions[chain.versions.len() - 1].clone(),
                status: chain.status,
            },
            // Caught up with the last write, replaced by someone else's, or too old.
            _ => {
                chains.remove(uid);
                StatusBase::Cache
            }
        }
    }

    fn record(&self, uid: &str, from: &str, to: String, status: u64) {
        let mut chains = self.chains.lock().unwrap_or_else(|p| p.into_inner());
        if chains.len() > 1024 {
            chains.retain(|_, c| c.at.elapsed() <= CHAIN_TTL);
        }
        let chain = chains.entry(uid.to_string()).or_insert_with(|| StatusChain {
            versions: vec![from.to_string()],
            status,
            at: std::time::Instant::now(),
        });
        chain.versions.push(to);
        chain.status = status;
        chain.at = std::time::Instant::now();
    }
}

/// Builds and runs a controller over `namespaces` (`None`: all) until the context's shutdown
/// signal; `synced` flips once every watch has listed.
pub(crate) fn run<R: Reconciler>(
    reconciler: R,
    ctx: ControllerContext,
    namespaces: Vec<Option<String>>,
    concurrency: u16,
    synced: Synced,
) -> BoxFuture<'static, ()> {
    let reconciler = Arc::new(reconciler);
    let limit = (concurrency > 0).then(|| Arc::new(Semaphore::new(concurrency.into())));
    let mut runs = Vec::new();
    for ns in namespaces {
        let client = ctx.client().clone();
        let (store, writer) = reflector::store();
        let trimmer = reconciler.clone();
        let primary = reflector::reflector(
            writer,
            watcher(
                api::<R::Object>(&client, ns.as_deref()),
                watcher::Config::default(),
            )
            .default_backoff()
            .modify(move |o| {
                o.managed_fields_mut().clear();
                trimmer.trim(o);
            }),
        )
        .inspect(synced.track())
        .applied_objects();
        let controller = Controller::for_stream(primary, store.clone())
            .with_config(ControllerConfig::default().concurrency(concurrency));
        let mut w = Watches {
            client,
            namespace: ns,
            controller: Some(controller),
            primary: Cache { store, index: None },
            synced: synced.clone(),
            pruners: Vec::new(),
            background: Vec::new(),
            metrics: ctx.metrics().clone(),
            field_manager: ctx.field_manager().to_string(),
        };
        w.primary.report(ctx.metrics());
        let cache = reconciler.watch(&mut w);
        let Watches {
            controller,
            pruners,
            background,
            ..
        } = w;
        let Some(controller) = controller else { continue };
        let runner = Arc::new(Runner {
            reconciler: reconciler.clone(),
            cache,
            pruners,
            synced: synced.subscribe(),
            ctx: ctx.clone(),
            limit: limit.clone(),
            written: StatusWrites::default(),
        });
        let shutdown = ctx.shutdown_signal();
        let background = async move {
            tokio::select! {
                _ = futures::future::join_all(background) => {},
                _ = shutdown => {},
            }
        };
        let controller = controller
            .graceful_shutdown_on(ctx.shutdown_signal())
            .run(
                |obj, runner: Arc<Runner<R>>| async move { runner.reconcile(obj).await },
                |obj, err, runner| runner.ctx.error_policy(obj.as_ref(), err),
                runner,
            )
            .for_each(|_| futures::future::ready(()));
        runs.push(async move { futures::join!(controller, background) }.boxed());
    }
    futures::future::join_all(runs).map(|_| ()).boxed()
}

impl<R: Reconciler> Runner<R> {
    async fn reconcile(&self, obj: Arc<R::Object>) -> Result<Action, Error> {
        // No decision on a half-filled cache: a missing child would look deleted.
        let mut synced = self.synced.clone();
        let _ = synced.wait_for(|s| *s).await;
        let _permit = match &self.limit {
            Some(s) => s.clone().acquire_owned().await.ok(),
            None => None,
        };
        let timer = self.ctx.metrics().reconcile_started();
        let result = self.reconcile_synced(&obj).await;
        match &result {
            Ok((_, outcome)) => {
                timer.finish(outcome);
                self.ctx.reconcile_succeeded(obj.as_ref());
            }
            Err(_) => timer.finish("error"),
        }
        result.map(|(action, _)| action)
    }

    #[tracing::instrument(skip_all, fields(controller = self.reconciler.name(), namespace = obj.namespace(), name = obj.name_any()))]
    async fn reconcile_synced(&self, obj: &R::Object) -> Result<(Action, &'static str), Error> {
        // observe (caches; a client read only where the controller asks for one)
        let world = self
            .reconciler
            .observe(obj, &self.cache, self.ctx.client())
            .await
            .map_err(|source| Error::Observe { source })?;
        let now = Timestamp::now();
        // plan (pure)
        match self.reconciler.plan(obj, &world, now) {
            Ok(plan) => {
                tracing::debug!(?plan.requeue, children = plan.children.len(), "planned");
                // carry out (client)
                let action = self.execute(obj, plan).await?;
                Ok((action, "success"))
            }
            Err(invalid) => {
                tracing::debug!(?invalid, "invalid spec");
                self.report_invalid(obj, invalid, now).await?;
                Ok((Action::await_change(), "invalid"))
            }
        }
    }

    async fn execute(&self, obj: &R::Object, plan: Plan<R::Status>) -> Result<Action, Error> {
        let ns = obj.namespace().unwrap_or_default();
        let mut produced = HashSet::new();
        for child in &plan.children {
            produced.insert((child.resource.kind.clone(), child.name.clone()));
            if child.needed {
                self.write(&ns, child).await?;
            }
        }
        if let Some(uid) = obj.uid() {
            for pruner in &self.pruners {
                for (resource, name) in pruner(&uid) {
                    if !produced.contains(&(resource.kind.clone(), name.clone())) {
                        self.prune(&ns, &resource, &name).await?;
                    }
                }
            }
        }
        if let Some(status) = plan.status {
            self.write_status(obj, serde_json::to_value(status)?).await?;
        }
        for e in plan.events {
            self.ctx.event(obj, &e).await;
        }
        if plan.delete {
            self.delete_object(obj).await?;
            return Ok(Action::await_change());
        }
        Ok(match plan.requeue {
            Requeue::OnChange => Action::await_change(),
            Requeue::After(d) => Action::requeue(d),
        })
    }

    async fn write(&self, ns: &str, child: &Child) -> Result<(), Error> {
        let child_ns = child.namespace.as_deref().unwrap_or(ns);
        let api: Api<DynamicObject> =
            Api::namespaced_with(self.ctx.client().clone(), child_ns, &child.resource);
        let err = |source| Error::Write {
            child: child.describe(),
            source,
        };
        match child.mode {
            Mode::Apply | Mode::Fields => {
                let pp = PatchParams::apply(self.ctx.field_manager()).force();
                self.ctx.may_write("apply")?;
                api.patch(&child.name, &pp, &Patch::Apply(&child.body))
                    .await
                    .map_err(err)?;
            }
            Mode::Create => {
                let obj: DynamicObject = serde_json::from_value(child.body.clone())?;
                self.ctx.may_write("create")?;
                match api.create(&PostParams::default(), &obj).await {
                    Ok(_) => {}
                    Err(kube::Error::Api(s)) if s.code == 409 => {
                        return Err(Error::Conflict {
                            child: child.describe(),
                        });
                    }
                    Err(e) => return Err(err(e)),
                }
            }
        }
        Ok(())
    }

    /// Deletes the primary object, only if it is still the one planned for (same uid).
    async fn delete_object(&self, obj: &R::Object) -> Result<(), Error> {
        let api: Api<R::Object> =
            Api::namespaced(self.ctx.client().clone(), &obj.namespace().unwrap_or_default());
        self.ctx.may_write("delete")?;
        let dp = DeleteParams {
            preconditions: Some(kube::api::Preconditions {
                uid: obj.uid(),
                resource_version: None,
            }),
            ..DeleteParams::background()
        };
        match api.delete(&obj.name_any(), &dp).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => Ok(()),
            Err(source) => Err(Error::Prune {
                child: format!("{} {}", R::Object::kind(&()), obj.name_any()),
                source,
            }),
        }
    }

    async fn prune(&self, ns: &str, resource: &ApiResource, name: &str) -> Result<(), Error> {
        let api: Api<DynamicObject> = Api::namespaced_with(self.ctx.client().clone(), ns, resource);
        self.ctx.may_write("delete")?;
        tracing::info!(
            kind = resource.kind,
            name,
            "deleting a child the plan no longer produces"
        );
        match api.delete(name, &DeleteParams::background()).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
            Err(source) => Err(Error::Prune {
                child: format!("{} {name}", resource.kind),
                source,
            }),
        }
    }

    /// Applies `desired` through the status subresource unless the live status has all of it.
    async fn write_status(&self, obj: &R::Object, desired: serde_json::Value) -> Result<bool, Error> {
        let uid = obj.uid().unwrap_or_default();
        let cached = obj.resource_version().unwrap_or_default();
        let precondition = match self.written.base(&uid, &cached) {
            StatusBase::Written { version, status } => {
                if status_hash(&desired) == status {
                    return Ok(false);
                }
                version
            }
            StatusBase::Cache => {
                let live: R::Status = serde_json::from_value(live_status(obj)?).unwrap_or_default();
                if is_subset(&desired, &serde_json::to_value(live)?) {
                    return Ok(false);
                }
                cached.clone()
            }
        };
        // The resourceVersion the plan saw is a precondition: a plan made from a stale cache
        // (another replica or reconcile wrote since) gets a conflict and is made again from
        // the newer object, so a status never goes backwards and its Events are not repeated.
        let body = serde_json::json!({
            "apiVersion": R::Object::api_version(&()),
            "kind": R::Object::kind(&()),
            "metadata": {"resourceVersion": precondition},
            "status": desired,
        });
        let api: Api<R::Object> =
            Api::namespaced(self.ctx.client().clone(), &obj.namespace().unwrap_or_default());
        let pp = PatchParams::apply(self.ctx.field_manager()).force();
        self.ctx.may_write("apply_status")?;
        match api.patch_status(&obj.name_any(), &pp, &Patch::Apply(&body)).await {
            Ok(written) => {
                if let Some(to) = written.resource_version() {
                    self.written
                        .record(&uid, &precondition, to, status_hash(&body["status"]));
                }
                Ok(true)
            }
            Err(kube::Error::Api(s)) if s.code == 409 => Err(Error::Stale),
            Err(source) => Err(Error::Status { source }),
        }
    }

    /// Records an invalid spec as a condition on the live status (every other status field
    /// kept, so the apply removes nothing) and warns once per change of that condition.
    async fn report_invalid(&self, obj: &R::Object, invalid: Invalid, now: Timestamp) -> Result<(), Error> {
        let mut status = live_status(obj)?;
        if !status.is_object() {
            status = serde_json::json!({});
        }
        let existing: Vec<Condition> =
            serde_json::from_value(status["conditions"].clone()).unwrap_or_default();
        let news = conditions::find(&existing, invalid.condition).is_none_or(|c| {
            c.status != if invalid.status { "True" } else { "False" }
                || c.reason != invalid.reason
                || c.message != invalid.message
        });
        let desired = Desired {
            type_: invalid.condition,
            status: Some(invalid.status),
            reason: invalid.reason,
            message: invalid.message.clone(),
        };
        let generation = obj.meta().generation;
        let mut all = vec![desired];
        all.extend(invalid.also.iter().cloned());
        let merged = conditions::merge(&existing, &all, generation, &Time(now));
        status["conditions"] = serde_json::to_value(merged)?;
        status["observedGeneration"] = serde_json::to_value(generation)?;
        self.write_status(obj, status).await?;
        if news {
            let e = crate::reconciler::Event::warning(invalid.reason, "Validate", invalid.message);
            self.ctx.event(obj, &e).await;
        }
        Ok(())
    }
}

/// Replaces `obj` by what `manager` applied to it ([`crate::diff::applied_by`]); leaves it
/// whole when the manager applied nothing or the projection does not make a valid object.
fn keep_applied<C: Serialize + DeserializeOwned>(obj: &mut C, manager: &str) {
    let Ok(value) = serde_json::to_value(&*obj) else {
        return;
    };
    if let Some(projected) = crate::diff::applied_by(&value, manager)
        && let Ok(trimmed) = serde_json::from_value(projected)
    {
        *obj = trimmed;
    }
}

fn live_status<K: Serialize>(obj: &K) -> Result<serde_json::Value, Error> {
    let mut v = serde_json::to_value(obj)?;
    Ok(v.get_mut("status")
        .map(serde_json::Value::take)
        .unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::Pod;

    fn pod(name: &str, owner: &str) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "ns", "labels": {"owner": owner}}
        }))
        .expect("pod")
    }

    fn owner(p: &Pod) -> Option<String> {
        p.labels().get("owner").cloned()
    }

    fn keyed(i: &Index<Pod>, key: &str) -> Vec<String> {
        let maps = i.maps.read().expect("lock");
        let mut names: Vec<String> = maps
            .by_key
            .get(key)
            .map(|s| s.iter().map(|r| r.name.clone()).collect())
            .unwrap_or_default();
        names.sort();
        names
    }

    #[test]
    fn the_index_follows_applies_relabels_deletes_and_swaps_in_a_relist_when_complete() {
        let i = Index {
            key: owner,
            maps: Default::default(),
        };
        i.observe(&Ok(watcher::Event::Apply(pod("a", "m1"))));
        i.observe(&Ok(watcher::Event::Apply(pod("b", "m1"))));
        assert_eq!(keyed(&i, "m1"), ["a", "b"]);
        i.observe(&Ok(watcher::Event::Apply(pod("b", "m2"))));
        assert_eq!(
            (keyed(&i, "m1"), keyed(&i, "m2")),
            (vec!["a".into()], vec!["b".into()])
        );
        i.observe(&Ok(watcher::Event::Delete(pod("a", "m1"))));
        assert!(keyed(&i, "m1").is_empty());
        // During a relist the old entries still answer; the new ones replace them at InitDone.
        i.observe(&Ok(watcher::Event::Init));
        i.observe(&Ok(watcher::Event::InitApply(pod("c", "m1"))));
        assert_eq!((keyed(&i, "m1"), keyed(&i, "m2")), (vec![], vec!["b".into()]));
        i.observe(&Ok(watcher::Event::InitDone));
        assert_eq!((keyed(&i, "m1"), keyed(&i, "m2")), (vec!["c".into()], vec![]));
    }
}
