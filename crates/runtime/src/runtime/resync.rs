//! The resync after a (re)list, behind the work that is actually new.
//!
//! When the operator starts (or a watch has to list again), every object it lists would be
//! reconciled in list order: 10000 objects that have not changed since the operator last saw
//! them queue ahead of the one created a second ago. So an initial list splits in two:
//! - *fresh*: a primary whose status does not yet describe its current generation (new,
//!   changed while the operator was down, still rolling out) or that is being deleted; it is
//!   reconciled at once, as any watch event is;
//! - *settled*: a primary whose status says it has seen its generation, and every owner of a
//!   listed child; these wait here and are handed to the work queue a batch at a time, only
//!   while the queue holds fewer than half a batch of them, so a new object waits behind at
//!   most one batch of resync work, and the resync, which has the workers whenever nothing
//!   else needs them, is never starved.
use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use kube::Resource;
use kube::runtime::reflector::ObjectRef;
use serde::{Deserialize, Serialize};
use tokio::sync::{Notify, watch};

use super::admission::{Handed, POLL};
use crate::cache::Cache;
use crate::runtime::context::ControllerContext;

/// The settled objects of one controller's watch scope, waiting for the queue to run short.
pub(crate) struct Resync<K: Resource<DynamicType = ()>> {
    inner: Mutex<Inner<K>>,
    wake: Notify,
    batch: usize,
    /// `opkit_resync_pending`, shared by the controller's namespaces, and what this one added.
    pending: prometheus_client::metrics::gauge::Gauge,
    reported: std::sync::atomic::AtomicI64,
}

struct Inner<K: Resource<DynamicType = ()>> {
    waiting: VecDeque<ObjectRef<K>>,
    queued: HashSet<ObjectRef<K>>,
    /// Handed to the work queue, not started yet.
    released: Handed<K>,
}

impl<K: Resource<DynamicType = ()> + Clone + Send + Sync + 'static> Resync<K> {
    /// `concurrency` is the controller's limit of reconciles at once (0: none).
    pub(crate) fn new(concurrency: u16, pending: prometheus_client::metrics::gauge::Gauge) -> Arc<Self> {
        let batch = if concurrency == 0 { 64 } else { concurrency.into() };
        Arc::new(Resync {
            inner: Mutex::new(Inner {
                waiting: VecDeque::new(),
                queued: HashSet::new(),
                released: Handed::default(),
            }),
            wake: Notify::new(),
            batch,
            pending,
            reported: Default::default(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner<K>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Moves the shared gauge by the change in what waits here.
    fn report(&self, inner: &Inner<K>) {
        let now = (inner.waiting.len() + inner.released.len()) as i64;
        let before = self.reported.swap(now, std::sync::atomic::Ordering::SeqCst);
        self.pending.inc_by(now - before);
    }

    /// Puts an object at the end of the resync (once, however often it is listed).
    pub(crate) fn defer(&self, r: ObjectRef<K>) {
        let mut inner = self.lock();
        if inner.queued.insert(r.clone()) {
            inner.waiting.push_back(r);
            self.report(&inner);
            drop(inner);
            self.wake.notify_one();
        }
    }

    /// A reconcile of `key` takes a worker: if it was handed out from here, it no longer waits.
    pub(crate) fn started(&self, key: &str) {
        let mut inner = self.lock();
        if inner.released.started(key) {
            self.report(&inner);
            if inner.released.has_room(self.batch) {
                drop(inner);
                self.wake.notify_one();
            }
        }
    }

    /// How many objects wait for their resync (not yet handed out).
    #[cfg(test)]
    fn waiting(&self) -> usize {
        self.lock().waiting.len()
    }

    /// The next batch to hand out, if the queue has room for one (fewer than half a batch
    /// handed out and not started); else when to look again (`None`: when woken). Only
    /// objects the primary cache has (`cached`) are handed out: a gone one, or the owner of a
    /// listed child that this controller does not reconcile, would never start.
    fn take(
        &self,
        now: Instant,
        cached: impl Fn(&ObjectRef<K>) -> bool,
    ) -> Result<Vec<ObjectRef<K>>, Option<Duration>> {
        let mut inner = self.lock();
        inner.released.forget_lost(now, &cached);
        self.report(&inner);
        if inner.waiting.is_empty() {
            return Err(None);
        }
        if !inner.released.has_room(self.batch) {
            return Err(Some(POLL));
        }
        let mut refs = Vec::with_capacity(self.batch);
        while refs.len() < self.batch {
            let Some(r) = inner.waiting.pop_front() else { break };
            inner.queued.remove(&r);
            if cached(&r) {
                inner.released.insert(r.clone(), now);
                refs.push(r);
            }
        }
        self.report(&inner);
        match refs.is_empty() {
            true => Err(None),
            false => Ok(refs),
        }
    }

    /// The reconcile requests of the resync: after the controller's caches have synced, while
    /// this replica leads, a batch whenever the queue has room.
    pub(crate) fn feed(
        self: Arc<Self>,
        ctx: ControllerContext,
        synced: watch::Receiver<bool>,
        primary: Cache<K>,
    ) -> impl Stream<Item = ObjectRef<K>> + Send + 'static {
        let state = (self, ctx, synced, primary);
        futures::stream::unfold(state, |(this, ctx, mut synced, primary)| async move {
            let _ = synced.wait_for(|s| *s).await;
            loop {
                ctx.leading().await;
                match this.take(Instant::now(), |r| primary.contains(r)) {
                    Ok(refs) => return Some((futures::stream::iter(refs), (this, ctx, synced, primary))),
                    Err(None) => this.wake.notified().await,
                    Err(Some(after)) => {
                        let _ = tokio::time::timeout(after, this.wake.notified()).await;
                    }
                }
            }
        })
        .flatten()
    }
}

impl<K: Resource<DynamicType = ()>> Drop for Resync<K> {
    /// A scope that stops (shutdown, a lost slot) no longer counts in the gauge.
    fn drop(&mut self) {
        self.pending
            .dec_by(self.reported.load(std::sync::atomic::Ordering::SeqCst));
    }
}

/// Whether a listed primary's status says it has seen its current generation (and it is not
/// being deleted): a top-level `status.observedGeneration` equal to `metadata.generation`, or,
/// without one, conditions that all carry it. A kind without generations, or a status that
/// says neither, counts as not settled: it is reconciled at once, as before.
pub(crate) fn settled<K: Resource + Serialize>(obj: &K) -> bool {
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Status {
        observed_generation: Option<i64>,
        #[serde(default)]
        conditions: Vec<Condition>,
    }
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Condition {
        observed_generation: Option<i64>,
    }
    let meta = obj.meta();
    let Some(generation) = meta.generation.filter(|_| meta.deletion_timestamp.is_none()) else {
        return false;
    };
    let Ok(status) = serde_json::from_value::<Status>(crate::diff::status_of(obj)) else {
        return false;
    };
    match status.observed_generation {
        Some(g) => g == generation,
        None => {
            !status.conditions.is_empty()
                && status
                    .conditions
                    .iter()
                    .all(|c| c.observed_generation == Some(generation))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::admission::STALE;
    use super::*;
    use k8s_openapi::api::apps::v1::{Deployment, DeploymentStatus};
    use k8s_openapi::api::core::v1::ConfigMap;

    fn deployment(generation: Option<i64>, status: Option<DeploymentStatus>) -> Deployment {
        let mut d = Deployment::default();
        d.metadata.name = Some("d".into());
        d.metadata.generation = generation;
        d.status = status;
        d
    }

    #[test]
    fn settled_means_the_status_has_seen_the_generation() {
        let seen = |g| {
            Some(DeploymentStatus {
                observed_generation: Some(g),
                ..Default::default()
            })
        };
        assert!(settled(&deployment(Some(2), seen(2))));
        assert!(!settled(&deployment(Some(3), seen(2))), "changed since");
        assert!(!settled(&deployment(Some(1), None)), "new: no status");
        assert!(!settled(&deployment(None, seen(1))), "no generation to compare");
        let mut deleting = deployment(Some(2), seen(2));
        deleting.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
        ));
        assert!(!settled(&deleting), "being deleted");
        assert!(!settled(&ConfigMap::default()), "a kind without status");
    }

    /// A custom kind: its status is whatever JSON the test gives.
    #[derive(Clone, Debug, serde::Serialize)]
    struct Custom {
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
        status: serde_json::Value,
    }

    impl Resource for Custom {
        type DynamicType = ();
        type Scope = k8s_openapi::NamespaceResourceScope;
        fn kind(_: &()) -> std::borrow::Cow<'_, str> {
            "Custom".into()
        }
        fn group(_: &()) -> std::borrow::Cow<'_, str> {
            "example.com".into()
        }
        fn version(_: &()) -> std::borrow::Cow<'_, str> {
            "v1".into()
        }
        fn plural(_: &()) -> std::borrow::Cow<'_, str> {
            "customs".into()
        }
        fn meta(&self) -> &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            &self.metadata
        }
        fn meta_mut(&mut self) -> &mut k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            &mut self.metadata
        }
    }

    #[test]
    fn without_a_top_level_observed_generation_every_condition_must_carry_it() {
        let custom = |status: serde_json::Value| {
            let metadata = k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                generation: Some(4),
                ..Default::default()
            };
            Custom { metadata, status }
        };
        let cond = |g: i64| serde_json::json!({"type": "Ready", "status": "True", "observedGeneration": g});
        assert!(settled(&custom(
            serde_json::json!({"conditions": [cond(4), cond(4)]})
        )));
        assert!(!settled(&custom(
            serde_json::json!({"conditions": [cond(4), cond(3)]})
        )));
        assert!(
            !settled(&custom(serde_json::json!({"conditions": []}))),
            "no conditions say nothing"
        );
        assert!(
            !settled(&custom(serde_json::json!({"phase": "Done"}))),
            "neither field"
        );
        assert!(
            settled(&custom(
                serde_json::json!({"observedGeneration": 4, "conditions": [cond(3)]})
            )),
            "the top-level field decides"
        );
        assert!(!settled(&custom(serde_json::json!({"conditions": "not a list"}))));
    }

    #[tokio::test]
    async fn a_batch_is_handed_out_only_while_the_queue_has_room() {
        let r: Arc<Resync<ConfigMap>> = Resync::new(4, Default::default());
        for i in 0..10 {
            r.defer(ObjectRef::new(&format!("c{i}")).within("ns"));
        }
        r.defer(ObjectRef::new("c0").within("ns"));
        assert_eq!(r.waiting(), 10, "listed twice, waiting once");
        let all = |_: &ObjectRef<ConfigMap>| true;
        let now = Instant::now();
        let first = r.take(now, all).expect("room for a batch");
        assert_eq!(first.len(), 4);
        assert_eq!(first[0].name, "c0", "in list order");
        assert!(r.take(now, all).is_err(), "four handed out, none started");
        r.started("ns/c0");
        r.started("ns/c1");
        assert!(r.take(now, all).is_err(), "two still wait: half a batch");
        r.started("ns/c2");
        let second = r.take(now, all).expect("fewer than half a batch wait");
        assert_eq!(second[0].name, "c4");
        // Handed out and never started: counted while the object is there, until LOST; a gone
        // one stops counting after STALE.
        assert!(r.take(now + STALE, all).is_err(), "still cached: still waiting");
        let third = r.take(now + STALE, |_| false);
        assert_eq!(
            third,
            Err(None),
            "all gone: the rest are dropped, nothing handed out"
        );
        assert_eq!(r.waiting(), 0);
    }

    #[test]
    fn one_worker_still_gets_the_resync_one_at_a_time() {
        let pending = prometheus_client::metrics::gauge::Gauge::default();
        let r: Arc<Resync<ConfigMap>> = Resync::new(1, pending.clone());
        r.defer(ObjectRef::new("a").within("ns"));
        r.defer(ObjectRef::new("b").within("ns"));
        assert_eq!(pending.get(), 2);
        let now = Instant::now();
        let all = |_: &ObjectRef<ConfigMap>| true;
        assert_eq!(r.take(now, all).map(|v| v.len()), Ok(1));
        assert!(r.take(now, all).is_err(), "a not started yet");
        assert_eq!(pending.get(), 2, "a handed out, not started: still pending");
        r.started("ns/a");
        assert_eq!(pending.get(), 1);
        assert_eq!(r.take(now, all).map(|v| v[0].name.clone()), Ok("b".to_string()));
        r.started("ns/b");
        assert_eq!(pending.get(), 0);
        r.defer(ObjectRef::new("c").within("ns"));
        drop(r);
        assert_eq!(pending.get(), 0, "a scope that stops no longer counts");
    }

    #[test]
    fn objects_the_cache_does_not_have_are_not_handed_out() {
        let r: Arc<Resync<ConfigMap>> = Resync::new(4, Default::default());
        for name in ["gone", "here", "other"] {
            r.defer(ObjectRef::new(name).within("ns"));
        }
        let refs = r.take(Instant::now(), |o| o.name != "gone").expect("two cached");
        let names: Vec<&str> = refs.iter().map(|o| o.name.as_str()).collect();
        assert_eq!(names, ["here", "other"]);
    }
}
