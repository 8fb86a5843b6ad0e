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
}

impl<C: Resource<DynamicType = ()> + Clone + 'static> Clone for Cache<C> {
    fn clone(&self) -> Self {
        Cache {
            store: self.store.clone(),
        }
    }
}

impl<C: Resource<DynamicType = ()> + Clone + 'static> Cache<C> {
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
}

impl<C> Watch<C> {
    /// Every object of the kind in scope.
    pub fn all() -> Self {
        Watch {
            labels: None,
            trim: |_| {},
            prune: false,
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
}

/// A namespaced kind opkit can watch and cache: what every watch, cache and primary needs.
pub trait Watchable:
    Resource<DynamicType = (), Scope = NamespaceResourceScope>
    + Clone
    + Debug
    + DeserializeOwned
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
        let (store, writer) = reflector::store();
        let stream = reflector::reflector(
            writer,
            watcher(api::<C>(&self.client, self.namespace.as_deref()), cfg)
                .default_backoff()
                .modify(move |o| {
                    o.managed_fields_mut().clear();
                    trim(o);
                }),
        )
        .inspect(self.synced.track())
        .touched_objects();
        (Cache { store }, stream)
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
            primary: Cache { store },
            synced: synced.clone(),
            pruners: Vec::new(),
            background: Vec::new(),
        };
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
        let live: R::Status = serde_json::from_value(live_status(obj)?).unwrap_or_default();
        let live = serde_json::to_value(live)?;
        if is_subset(&desired, &live) {
            return Ok(false);
        }
        // The resourceVersion the plan saw is a precondition: a plan made from a stale cache
        // (another replica or reconcile wrote since) gets a conflict and is made again from
        // the newer object, so a status never goes backwards and its Events are not repeated.
        let body = serde_json::json!({
            "apiVersion": R::Object::api_version(&()),
            "kind": R::Object::kind(&()),
            "metadata": {"resourceVersion": obj.resource_version()},
            "status": desired,
        });
        let api: Api<R::Object> =
            Api::namespaced(self.ctx.client().clone(), &obj.namespace().unwrap_or_default());
        let pp = PatchParams::apply(self.ctx.field_manager()).force();
        self.ctx.may_write("apply_status")?;
        match api.patch_status(&obj.name_any(), &pp, &Patch::Apply(&body)).await {
            Ok(_) => Ok(true),
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

fn live_status<K: Serialize>(obj: &K) -> Result<serde_json::Value, Error> {
    let mut v = serde_json::to_value(obj)?;
    Ok(v.get_mut("status")
        .map(serde_json::Value::take)
        .unwrap_or_default())
}
