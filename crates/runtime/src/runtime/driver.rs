//! One reconcile, start to end: wait for the caches to sync and for a slot, observe, then
//! either plan and carry the plan out, or — for an object being deleted — run its cleanup and
//! release its finalizer; bounded by the controller's timeout, with backoff on failure.
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use k8s_openapi::jiff::Timestamp;
use kube::{Resource, ResourceExt};
use tokio::sync::{Semaphore, watch};
use tracing::Instrument;

use super::Error;
use super::hold::Hold;
use super::queue::Action;
use super::shared::Synced;
use super::watches::{Adopter, Pruner, Watches};
use super::write::Writer;
use crate::cache::Cache;
use crate::conditions::Desired;
use crate::conditions::{CLEANUP_FAILED, DELETING};
use crate::plan::{Act, Cleanup, Deletion, Event, Invalid, Plan, Requeue, Retry, finalizer_name};
use crate::reconciler::Reconciler;
use crate::runtime::context::ControllerContext;

/// How long a reconcile whose write the gate refused waits for the elector to announce the
/// end of its term (both follow from one missed renewal) before it counts as failed.
const NOT_LEADER_GRACE: Duration = Duration::from_secs(2);

/// The shortest wait a [`Retry`] gets: a `Retry-After: 0` passed on does not call the outside
/// service in a loop.
const MIN_RETRY: Duration = Duration::from_secs(1);

/// What the progress hold knows an object by: its uid, so a recreated object starts afresh.
fn hold_key<K: Resource>(obj: &K) -> String {
    obj.uid().unwrap_or_else(|| obj.name_any())
}

/// The text a panic was raised with (`panic!("...")` gives a `&str` or a `String`).
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    match (panic.downcast_ref::<&str>(), panic.downcast_ref::<String>()) {
        (Some(s), _) => s.to_string(),
        (_, Some(s)) => s.clone(),
        _ => "a panic without a message".to_string(),
    }
}

/// One watch scope (namespace) of one controller.
struct Runner<R: Reconciler> {
    reconciler: Arc<R>,
    /// The primary objects, as the work queue hands them out.
    primary: Cache<R::Object>,
    cache: R::Caches,
    pruners: Vec<Pruner>,
    adopters: Vec<Adopter>,
    synced: watch::Receiver<bool>,
    ctx: ControllerContext,
    limit: Option<Arc<Semaphore>>,
    writer: Arc<Writer>,
    finalizer: Option<String>,
    /// Shared by the controller's namespaces: one progress budget per controller.
    hold: Arc<Hold>,
    queue: crate::metrics::Queue,
    resync: Arc<super::resync::Resync<R::Object>>,
    admission: Arc<super::admission::Admission<R::Object>>,
    /// The outside sources the plans' acts go to.
    actors: crate::outside::Actors,
}

/// Builds and runs a controller over `namespaces` (`None`: all; a cluster-scoped primary kind
/// is watched once, cluster-wide) until the context's shutdown signal; `synced` flips once
/// every watch has listed.
pub(crate) fn run<R: Reconciler>(
    reconciler: R,
    ctx: ControllerContext,
    namespaces: Vec<Option<String>>,
    synced: Synced,
) -> BoxFuture<'static, ()> {
    let reconciler = Arc::new(reconciler);
    let concurrency = ctx.tuning().concurrency;
    ctx.metrics().max_concurrent(concurrency);
    let limit = (concurrency > 0).then(|| Arc::new(Semaphore::new(concurrency.into())));
    let namespaces = if crate::kind::namespaced::<R::Object>() {
        namespaces
    } else {
        vec![None]
    };
    let writer = Arc::new(Writer::new(ctx.clone()));
    let finalizer = reconciler.cleans_up().then(|| finalizer_name(reconciler.name()));
    let hold = Arc::new(Hold::new(
        ctx.tuning().progress_delay,
        ctx.tuning().progress_budget,
    ));
    let mut runs = Vec::new();
    for ns in namespaces {
        let mut w = Watches::new(reconciler.primary(), &ctx, ns, synced.clone(), concurrency);
        let cache = reconciler.watch(&mut w);
        let primary = w.primary();
        let Watches {
            controller,
            pruners,
            adopters,
            background,
            resync,
            admission,
            actors,
            ..
        } = w;
        let Some(controller) = controller else { continue };
        let runner = Arc::new(Runner {
            reconciler: reconciler.clone(),
            primary,
            cache,
            pruners,
            adopters,
            synced: synced.subscribe(),
            ctx: ctx.clone(),
            limit: limit.clone(),
            writer: writer.clone(),
            finalizer: finalizer.clone(),
            hold: hold.clone(),
            queue: ctx.metrics().queue(),
            resync,
            admission,
            actors,
        });
        let shutdown = ctx.shutdown_signal();
        let background = async move {
            tokio::select! {
                _ = futures::future::join_all(background) => {},
                _ = shutdown => {},
            }
        };
        let controller = controller.graceful_shutdown_on(ctx.shutdown_signal()).run(
            move |obj: Arc<R::Object>| {
                let runner = runner.clone();
                // From the moment the copy is handed out until the run ends, opkit's status
                // writes of the object are remembered even once the cache shows them: the run
                // plans from this copy.
                let busy = runner
                    .ctx
                    .status_writes()
                    .busy(obj.meta().uid.as_deref().unwrap_or_default());
                async move {
                    let _busy = busy;
                    runner.reconcile(obj).await
                }
            },
            {
                let ctx = ctx.clone();
                move |obj, err| ctx.error_policy(obj, err)
            },
        );
        runs.push(async move { futures::join!(controller, background) }.boxed());
    }
    futures::future::join_all(runs).map(|_| ()).boxed()
}

impl<R: Reconciler> Runner<R> {
    async fn reconcile(&self, obj: Arc<R::Object>) -> Result<Action, Error> {
        // No decision on a half-filled cache: a missing child would look deleted.
        let mut synced = self.synced.clone();
        let _ = synced.wait_for(|s| *s).await;
        // A standby (warm, or one that lost the Lease) holds its caches, not its reconciles,
        // until it leads; at shutdown it has nothing to finish. The object it was handed may
        // be long out of date by then: it goes back to the work queue, which hands over the
        // current one (or nothing, if it is gone).
        if !self.ctx.is_leading() {
            tokio::select! {
                biased;
                _ = self.ctx.leading() => return Ok(Action::requeue(Duration::ZERO)),
                _ = self.ctx.shutdown_signal() => return Ok(Action::await_change()),
            }
        }
        // The Lease lost midway (or lost and won back before this task ran again): the
        // reconcile is dropped where it stands (its writes are refused from then on anyway)
        // and the object waits to be reconciled when this replica leads again. Not a failure:
        // it is neither counted nor backed off.
        let term = self.ctx.term();
        tokio::select! {
            biased;
            _ = crate::runtime::context::term_ended(term) => {
                tracing::debug!(object = %obj.name_any(), "leadership lost: reconcile dropped");
                Ok(Action::requeue(Duration::ZERO))
            }
            r = self.reconcile_leading(&obj) => r,
        }
    }

    async fn reconcile_leading(&self, obj: &Arc<R::Object>) -> Result<Action, Error> {
        // Waiting for a worker slot is waiting in the queue: a requeue that fell due (no watch
        // event announced it) counts from here.
        let key = super::shared::queue_key(obj.namespace().as_deref(), &obj.name_any());
        self.queue.add(key.clone(), Box::new(|| true));
        let (_permit, waited) = match &self.limit {
            Some(s) => match s.clone().try_acquire_owned() {
                Ok(p) => (Some(p), false),
                Err(_) => (s.clone().acquire_owned().await.ok(), true),
            },
            None => (None, false),
        };
        let _work = self.queue.start(&key);
        self.resync.started(&key);
        self.admission.started(&key);
        // After a wait for a slot (the controller's namespaces share them), the object as the
        // cache holds it now: the copy handed out before may have changed since, and a plan
        // from it would be refused as stale.
        let current;
        let obj = match waited {
            false => obj,
            true => match self.primary.get_key(&key) {
                Some(o) => {
                    current = o;
                    &current
                }
                None => return Ok(Action::await_change()),
            },
        };
        let timer = self.ctx.metrics().reconcile_started();
        let timeout = self.ctx.tuning().timeout;
        // A panic (in a plan, an observe, a mapper) fails this object's reconcile only: it is
        // counted, logged and retried with backoff while the other objects carry on.
        let run = std::panic::AssertUnwindSafe(self.reconcile_synced(obj)).catch_unwind();
        let result = match tokio::time::timeout(timeout, run).await {
            Ok(Ok(r)) => r,
            Ok(Err(panic)) => {
                self.ctx.metrics().reconcile_panicked();
                Err(Error::Panic {
                    message: panic_message(panic.as_ref()),
                })
            }
            Err(_) => Err(Error::Timeout { after: timeout }),
        }
        .map_err(Error::or_not_leader);
        if matches!(result, Err(Error::NotLeader)) {
            // Refused as the Lease ran out, just before the elector said so: the end of the
            // term, once it is announced, drops this reconcile uncounted (see `reconcile`).
            tokio::select! {
                _ = tokio::time::sleep(NOT_LEADER_GRACE) => {},
                _ = self.ctx.shutdown_signal() => {},
            }
        }
        match &result {
            Ok((_, outcome)) => {
                timer.finish(outcome);
                if *outcome != "cleanup_pending" {
                    self.ctx.reconcile_succeeded(obj.as_ref());
                }
            }
            Err(Error::NamespaceTerminating { .. }) => timer.finish("namespace_terminating"),
            Err(_) => timer.finish("error"),
        }
        result.map(|(action, _)| action)
    }

    #[tracing::instrument(name = "reconcile", skip_all, fields(controller = self.reconciler.name(), namespace = obj.namespace(), object = obj.name_any(), trace_id = tracing::field::Empty))]
    async fn reconcile_synced(&self, obj: &R::Object) -> Result<(Action, &'static str), Error> {
        crate::trace::record_trace_id(&tracing::Span::current());
        let adopted;
        let obj = match self.ctx.shard() {
            Some(shard) => {
                if let Some(outcome) = self.shard_check(obj, shard).await? {
                    return Ok((Action::await_change(), outcome));
                }
                if obj.annotations().contains_key(&shard.adopt) {
                    let uid = obj.uid().unwrap_or_default();
                    if shard.adopted.is_replaced(&uid, obj.resource_version().as_deref()) {
                        // Adopted already, and planned from the object written then; this
                        // copy is older. Looked at again once the cache has the newer one.
                        return Ok((Action::requeue(Duration::from_secs(1)), "stale_copy"));
                    }
                    adopted = self.adopt(obj, shard).await?;
                    if let Some(rv) = obj.resource_version() {
                        shard.adopted.insert(uid, rv);
                    }
                    &adopted
                } else {
                    obj
                }
            }
            None => obj,
        };
        let deleting = obj.meta().deletion_timestamp.is_some();
        let ours = self
            .finalizer
            .as_deref()
            .filter(|f| obj.finalizers().iter().any(|x| x == f));
        if deleting {
            self.hold.settled(&hold_key(obj), std::time::Instant::now());
        }
        if deleting && ours.is_none() {
            // Going away, and nothing of ours holds it: no plan for a terminating object.
            return Ok((Action::await_change(), "deleting"));
        }
        if let (Some(f), false, None) = (&self.finalizer, deleting, ours) {
            // The finalizer goes on before anything else is written for the object, so no
            // child can outlive it unnoticed; its watch event brings the object back here.
            self.writer.finalizer(obj, f, true).await?;
            return Ok((Action::await_change(), "finalizer_added"));
        }
        // The owned children the plan can see: only these may be pruned. One that reaches a
        // cache after this is seen by the next reconcile, which its watch event brings.
        let prunable: Vec<Deletion> = match (deleting, obj.uid()) {
            (false, Some(uid)) => self.pruners.iter().flat_map(|p| p(&uid)).collect(),
            _ => Vec::new(),
        };
        // observe (caches; a client read only where the controller asks for one)
        let observed = self
            .reconciler
            .observe(obj, &self.cache, self.ctx.client())
            .instrument(tracing::debug_span!("observe"))
            .await;
        let now = Timestamp::now();
        let world = match observed {
            Ok(world) => world,
            Err(source) => match Retry::of(&source) {
                Some(retry) => return self.report_invalid(obj, retry.clone().into(), now).await,
                None => return Err(Error::Observe { source }),
            },
        };
        if let (true, Some(f)) = (deleting, ours) {
            // cleanup (pure), then carried out
            let cleanup =
                tracing::debug_span!("cleanup").in_scope(|| self.reconciler.cleanup(obj, &world, now));
            return self.clean_up(obj, f, cleanup, now).await;
        }
        // plan (pure)
        match tracing::debug_span!("plan").in_scope(|| self.reconciler.plan(obj, &world, now)) {
            Ok(plan) => {
                tracing::debug!(?plan.requeue, children = plan.children.len(), "planned");
                // carry out (client; the outside world through the plan's acts)
                match self.execute(obj, plan, prunable, now).await {
                    Ok(action) => Ok((action, "success")),
                    Err(Error::Act { act, mut retry }) => {
                        retry.message = format!("{act}: {}", retry.message);
                        self.report_invalid(obj, retry.into(), now).await
                    }
                    Err(e) => Err(e),
                }
            }
            Err(invalid) => {
                tracing::debug!(?invalid, "invalid spec");
                self.report_invalid(obj, invalid, now).await
            }
        }
    }

    /// For a sharded controller: whether `obj` is not this replica's to reconcile (placed
    /// elsewhere, let go of, or asked back by the sharder, which is done here), and why.
    async fn shard_check(
        &self,
        obj: &R::Object,
        shard: &crate::runtime::context::Shard,
    ) -> Result<Option<&'static str>, Error> {
        if obj.labels().get(&shard.label) != Some(&shard.member) {
            return Ok(Some("not_placed_here"));
        }
        let uid = obj.uid().unwrap_or_default();
        if shard
            .released
            .is_replaced(&uid, obj.resource_version().as_deref())
        {
            return Ok(Some("released"));
        }
        if !obj.labels().contains_key(&shard.drain) {
            return Ok(None);
        }
        if let Some(rv) = self.writer.release(obj, shard).await? {
            tracing::info!(object = %obj.name_any(), "let go of, as the sharder asked");
            shard.released.insert(uid, rv);
        }
        Ok(Some("released"))
    }

    /// Takes the children of an object moved here over from its previous owner, before
    /// anything is planned from this member's caches; then takes the sharder's note off.
    /// Returns the object as that last write left it.
    async fn adopt(
        &self,
        obj: &R::Object,
        shard: &crate::runtime::context::Shard,
    ) -> Result<R::Object, Error> {
        let uid = obj.uid().unwrap_or_default();
        for adopter in &self.adopters {
            adopter(uid.clone()).await?;
        }
        self.writer.adopted(obj, shard).await
    }

    async fn execute(
        &self,
        obj: &R::Object,
        plan: Plan<R::Status>,
        prunable: Vec<Deletion>,
        now: Timestamp,
    ) -> Result<Action, Error> {
        let ns = obj.namespace();
        let mut produced = HashSet::new();
        // A child refused as its namespace goes holds up nothing else of the plan; the
        // refusal is reported once the rest is carried out.
        let mut refused = None;
        for child in &plan.children {
            let at = child.namespace(ns.as_deref()).map(String::from);
            produced.insert((child.resource.kind.clone(), at, child.name.clone()));
            if child.needed {
                match self
                    .writer
                    .child(ns.as_deref(), child, obj.uid().as_deref())
                    .await
                {
                    Err(e @ Error::NamespaceTerminating { .. }) => {
                        refused.get_or_insert(e);
                    }
                    r => r?,
                }
            }
        }
        for gone in &plan.deletes {
            tracing::info!(child = gone.describe(), "deleting as planned");
            self.writer.delete(gone).await?;
        }
        let key = |c: &Deletion| (c.resource.kind.clone(), c.namespace.clone(), c.name.clone());
        let seen: HashSet<_> = prunable.iter().map(key).collect();
        for child in prunable {
            if !produced.contains(&key(&child)) {
                self.writer.prune(&child).await?;
            }
        }
        // The status was planned before the acts: when they changed something, the next
        // plan, which sees it, writes the status instead.
        let acted = self.act(plan.acts).await?;
        // Owned children that reached the caches after the plan observed, and that it does
        // not produce: looked at again shortly, by a plan that sees them (their watch event
        // may be this controller's own echo, which brings no reconcile).
        let late = match obj.uid() {
            Some(uid) => self
                .pruners
                .iter()
                .flat_map(|p| p(&uid))
                .any(|c| !seen.contains(&key(&c)) && !produced.contains(&key(&c))),
            None => false,
        };
        let hold_key = hold_key(obj);
        // A status still in progress waits (see Plan::in_progress); one that must be stored
        // before the next step never does.
        let mut status = plan.status.map(serde_json::to_value).transpose()?;
        let mut warnings = Vec::new();
        if !plan.degraded.is_empty() {
            let (degraded, news) = super::write::degraded_status(
                status,
                &crate::diff::status_of(obj),
                &plan.degraded,
                obj.meta().generation,
                &k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(now),
            )?;
            status = Some(degraded);
            warnings = news.into_iter().map(|n| &plan.degraded[n]).collect();
        }
        // A part of the spec left out is shown at once, never held as progress.
        // After an act that changed something the status waits for the next plan: no hold.
        let holdable = plan.in_progress && plan.degraded.is_empty() && !acted;
        let held = if holdable
            && plan.requeue != Requeue::Again
            && let Some(status) = &status
        {
            // Progress already shown (or unchanged) costs nothing from the budget.
            if self.writer.status_stored::<_, R::Status>(obj, status)? {
                None
            } else {
                self.hold.in_progress(&hold_key, std::time::Instant::now())
            }
        } else {
            self.hold.settled(&hold_key, std::time::Instant::now());
            None
        };
        let wrote = match (status, held) {
            (Some(_), _) if acted => false,
            (Some(_), Some(wait)) => {
                tracing::debug!(?wait, "status in progress, held back");
                false
            }
            (Some(status), None) => {
                let echo = plan.requeue != Requeue::Again;
                self.writer.status::<_, R::Status>(obj, status, echo).await?
            }
            (None, _) => false,
        };
        // Warned about with the write that shows the condition (a plan made from a cache
        // that has not seen that write yet writes nothing, and does not warn again).
        for invalid in warnings.into_iter().filter(|_| wrote) {
            tracing::info!(reason = invalid.reason, message = %invalid.message, "part of the spec left out");
            let e = Event::warning(invalid.reason, "Validate", invalid.message.clone());
            self.ctx.event(obj, &e).await;
        }
        for e in plan.events {
            self.ctx.event(obj, &e).await;
        }
        if plan.delete {
            self.writer.delete_object(obj).await?;
            return Ok(Action::await_change());
        }
        if let Some(e) = refused {
            return Err(e);
        }
        const LATE_CHILD: Duration = Duration::from_secs(1);
        if acted {
            return Ok(Action::requeue(super::watches::ACTED));
        }
        Ok(match (plan.requeue, held) {
            (Requeue::After(d), Some(wait)) => Action::requeue(d.min(wait)),
            (Requeue::OnChange, Some(wait)) => Action::requeue(wait),
            (Requeue::OnChange, None) if late => Action::requeue(LATE_CHILD),
            (Requeue::OnChange, None) => Action::await_change(),
            (Requeue::After(d), None) if late => Action::requeue(d.min(LATE_CHILD)),
            (Requeue::After(d), None) => Action::requeue(d),
            // The stored status's watch event brings the object back.
            (Requeue::Again, _) => Action::await_change(),
        })
    }

    /// Carries a cleanup out: deletions, then the acts outside the cluster in order, then — when the
    /// cleanup is done — the status and Events, and the finalizer comes off. A failed step
    /// is shown as a condition and a Warning Event and retried with backoff; a cleanup not
    /// done yet looks again after a growing delay (and on any watched change).
    async fn clean_up(
        &self,
        obj: &R::Object,
        finalizer: &str,
        mut cleanup: Cleanup<R::Status>,
        now: Timestamp,
    ) -> Result<(Action, &'static str), Error> {
        let acts = std::mem::take(&mut cleanup.acts);
        if let Err(failure) = self.cleanup_steps(&cleanup.deletes, acts).await {
            if matches!(failure, Error::NotLeader) {
                return Err(failure);
            }
            let message = match &failure {
                Error::Cleanup { message } => message.clone(),
                Error::Act { act, retry } => format!("cleanup step {act} failed: {}", retry.message),
                other => format!("cleanup failed: {other}"),
            };
            let desired = vec![Desired::yes(DELETING, CLEANUP_FAILED, message.clone())];
            // A kind without a status (a ConfigMap) still gets the Event, on every failure.
            let news = self
                .writer
                .conditions::<_, R::Status>(obj, desired, now)
                .await
                .inspect_err(|e| tracing::debug!(error = %e, "no condition for the failed cleanup"))
                .unwrap_or(true);
            if news {
                let e = Event::warning(CLEANUP_FAILED, "Cleanup", message);
                self.ctx.event(obj, &e).await;
            }
            // A failed act says when to try again.
            if let Error::Act { retry, .. } = &failure {
                return Ok((Action::requeue(retry.after.max(MIN_RETRY)), "retry"));
            }
            return Err(failure);
        }
        if let Some(status) = cleanup.status {
            self.writer
                .status::<_, R::Status>(obj, serde_json::to_value(status)?, true)
                .await?;
        }
        for e in &cleanup.events {
            self.ctx.event(obj, e).await;
        }
        if !cleanup.done {
            return Ok((Action::requeue(self.ctx.pending_delay(obj)), "cleanup_pending"));
        }
        self.writer.finalizer(obj, finalizer, false).await?;
        tracing::info!("cleanup done, finalizer removed");
        Ok((Action::await_change(), "cleaned_up"))
    }

    /// Every deletion (one failing does not keep the others from being tried), then — once
    /// they all succeeded — the acts outside the cluster in order, up to the first that fails.
    async fn cleanup_steps(&self, deletes: &[Deletion], acts: Vec<Act>) -> Result<(), Error> {
        let mut failed = Vec::new();
        for d in deletes {
            match self.writer.delete(d).await {
                Ok(()) => {}
                Err(Error::NotLeader) => return Err(Error::NotLeader),
                Err(e) => failed.push(e.to_string()),
            }
        }
        if !failed.is_empty() {
            return Err(Error::Cleanup {
                message: format!("cleanup failed: {}", failed.join("; ")),
            });
        }
        self.act(acts).await.map(|_| ())
    }

    /// Carries `acts` out in order, each only while this replica may write, up to the first
    /// that fails; returns whether any of them changed its thing (as read again after it).
    async fn act(&self, acts: Vec<Act>) -> Result<bool, Error> {
        let mut changed = false;
        for act in acts {
            let what = act.describe();
            let Some(actor) = self.actors.get(&act.source) else {
                return Err(Error::Undeclared { act: what });
            };
            self.ctx.may_call()?;
            let step = format!("{}.{}", actor.name(), act.name);
            let span = tracing::info_span!("act", source = actor.name(), act = %what);
            match actor.run(act).instrument(span).await {
                Ok(c) => {
                    self.ctx.metrics().call_ended(&step, "ok");
                    tracing::info!(act = %what, changed = c, "acted outside the cluster");
                    changed |= c;
                }
                Err(retry) => {
                    self.ctx.metrics().call_ended(&step, "retry");
                    return Err(Error::Act { act: what, retry });
                }
            }
        }
        Ok(changed)
    }

    /// Records an invalid spec or a [`Retry`] as its condition (one Warning Event when that
    /// changes); a retry comes back after its delay, an invalid spec with the next change.
    async fn report_invalid(
        &self,
        obj: &R::Object,
        invalid: Invalid,
        now: Timestamp,
    ) -> Result<(Action, &'static str), Error> {
        if let Some(after) = invalid.retry {
            tracing::info!(reason = invalid.reason, message = %invalid.message, ?after, "trying again later");
        }
        let mut all = vec![Desired {
            type_: invalid.condition,
            status: Some(invalid.status),
            reason: invalid.reason,
            message: invalid.message.clone(),
        }];
        all.extend(invalid.also.iter().cloned());
        if self.writer.conditions::<_, R::Status>(obj, all, now).await? {
            let action = if invalid.retry.is_some() {
                "Reconcile"
            } else {
                "Validate"
            };
            let e = Event::warning(invalid.reason, action, invalid.message);
            self.ctx.event(obj, &e).await;
        }
        Ok(match invalid.retry {
            Some(after) => (Action::requeue(after.max(MIN_RETRY)), "retry"),
            None => (Action::await_change(), "invalid"),
        })
    }
}
