//! The work queue of one controller's watch scope, and the loop that runs its reconciles:
//! requests for one object merge (the earliest wins), an object is reconciled once at a time
//! (a request that comes meanwhile waits for the end of the run), at most `concurrency` at
//! once, each handed the object as the primary cache holds it when its run starts (a request
//! for an object the cache no longer has is dropped; one for an object the cache does not hold
//! while the primary watch lists again waits for the end of that list, which may bring it).
//!
//! This is what kube-runtime's `Controller` does, kept here for two costs. Its controller reads
//! the primary objects from a `Store` of decoded objects (it hands out `Arc<K>`), so a compact
//! primary cache ([`crate::Watch::compact`]: about a fifth of the memory of a decoded custom
//! resource) could not serve it. And its scheduler keeps each request as the object's
//! reference (four strings) and a reason, in a delay queue and again in a map: about half a
//! KiB per object, held for the whole hour by every object of a settled operator whose plans
//! ask for an hourly safety net. Here a waiting request is the object's `namespace/name`,
//! shared by a map and an ordered set, and the millisecond it falls due: never early, at most a
//! millisecond late (a schedule that starts a job at its minute must not slip a second).
use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::stream::{BoxStream, FuturesUnordered};
use futures::{FutureExt, Stream, StreamExt};
use kube::ResourceExt;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use tokio::time::Instant;

use crate::cache::Cache;
use crate::kind::{Watchable, namespaced};

/// What a reconcile asks for next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Action {
    after: Option<Duration>,
}

impl Action {
    /// Reconcile again `after` from the end of this run (sooner if something changes).
    pub(crate) fn requeue(after: Duration) -> Self {
        Action { after: Some(after) }
    }

    /// Reconcile again only when something changes.
    pub(crate) fn await_change() -> Self {
        Action { after: None }
    }
}

/// When a waiting request falls due: the millisecond (since the queue's start), then the
/// order it came in (requests due at one millisecond are served first come, first served).
type Due = (u64, u64);

/// The requests of one watch scope: those waiting, by when each falls due, and the objects
/// being reconciled.
struct Line {
    due: HashMap<Arc<str>, Due>,
    /// The same requests, earliest first.
    order: BTreeMap<Due, Arc<str>>,
    /// Requests so far: the next one's place among those due at its millisecond.
    count: u64,
    /// The objects being reconciled, each with the earliest request that came meanwhile.
    running: HashMap<Arc<str>, Option<u64>>,
    /// Whether the primary watch lists again (the cache swaps the list in at its end).
    listing: bool,
    /// Requests for objects not cached while the primary watch lists: asked for again at
    /// the end of the list.
    parked: Vec<Arc<str>>,
}

impl Line {
    /// A request for `key` at `at`: a waiting request for it stays if it is earlier; one for
    /// an object being reconciled waits for the end of that run.
    fn request(&mut self, key: Arc<str>, at: u64) {
        if at == u64::MAX {
            return;
        }
        if let Some(next) = self.running.get_mut(&key) {
            *next = Some(next.map_or(at, |n| n.min(at)));
            return;
        }
        if self.due.get(&key).is_some_and(|old| old.0 <= at) {
            return;
        }
        if let Some(old) = self.due.remove(&key) {
            self.order.remove(&old);
        }
        self.count += 1;
        let due = (at, self.count);
        self.due.insert(key.clone(), due);
        self.order.insert(due, key);
    }

    /// The requests due by `passed`, at most `room` of them; each object taken counts as
    /// being reconciled until [`Line::done`].
    fn take(&mut self, passed: u64, room: usize) -> Vec<Arc<str>> {
        let mut keys = Vec::new();
        while keys.len() < room
            && self
                .order
                .first_key_value()
                .is_some_and(|((at, _), _)| *at <= passed)
        {
            if let Some((_, key)) = self.order.pop_first() {
                self.due.remove(&key);
                self.running.insert(key.clone(), None);
                keys.push(key);
            }
        }
        keys
    }

    /// The end of `key`'s run, which asks to run again at `again` (none: not unless asked).
    fn done(&mut self, key: &str, again: Option<u64>) {
        if let Some((key, meanwhile)) = self.running.remove_entry(key) {
            let at = match (meanwhile, again) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            if let Some(at) = at {
                self.request(key, at);
            }
        }
    }
}

/// The work queue of one watch scope, shared with the watches (a deleted object's request
/// goes with it).
pub(crate) struct Queue {
    line: Mutex<Line>,
    start: Instant,
    /// Wakes the loop when requests come from outside it (parked ones at the end of a list).
    woken: tokio::sync::Notify,
}

impl Queue {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Queue {
            line: Mutex::new(Line {
                due: HashMap::new(),
                order: BTreeMap::new(),
                count: 0,
                running: HashMap::new(),
                listing: false,
                parked: Vec::new(),
            }),
            start: Instant::now(),
            woken: tokio::sync::Notify::new(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Line> {
        self.line.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The millisecond (since `start`) when a request `after` from `now` falls due: the one
    /// under way for a request for now, else the first at or after it (never early; `u64::MAX`:
    /// later than an `Instant` can say).
    fn due_after(&self, now: Instant, after: Duration) -> u64 {
        match after.is_zero() {
            true => self.passed(now),
            false => self.due_at(now.checked_add(after)),
        }
    }

    /// The millisecond (since `start`) at or after `at` (none: later than an `Instant` can say).
    fn due_at(&self, at: Option<Instant>) -> u64 {
        let Some(at) = at else { return u64::MAX };
        let d = at.saturating_duration_since(self.start);
        let ms = d.as_millis() + u128::from(d.subsec_nanos() % 1_000_000 > 0);
        u64::try_from(ms).unwrap_or(u64::MAX)
    }

    /// The milliseconds (since `start`) that have passed at `now`: the requests due by then.
    fn passed(&self, now: Instant) -> u64 {
        u64::try_from(now.saturating_duration_since(self.start).as_millis()).unwrap_or(u64::MAX)
    }

    /// How long from `now` until the millisecond `ms` (none: too far to wait for).
    fn until(&self, ms: u64, now: Instant) -> Option<Duration> {
        if ms == u64::MAX {
            return None;
        }
        let at = self.start.checked_add(Duration::from_millis(ms))?;
        Some(at.saturating_duration_since(now))
    }

    /// Asks for a reconcile of `key` (`namespace/name`) `after` from `now`.
    pub(crate) fn request(&self, key: &str, now: Instant, after: Duration) {
        let at = self.due_after(now, after);
        self.lock().request(key.into(), at);
    }

    /// Forgets the waiting request of `key`, if it has one (its object was deleted).
    pub(crate) fn clear(&self, key: &str) {
        let mut line = self.lock();
        if let Some(due) = line.due.remove(key) {
            line.order.remove(&due);
        }
        if let Some(meanwhile) = line.running.get_mut(key) {
            *meanwhile = None;
        }
    }

    /// Follows the primary watch's events: a deleted object's request goes with it, and the
    /// requests parked while the watch lists again are asked for at the end of the list (the
    /// cache holds the listed objects from then on).
    pub(crate) fn follow<K: kube::Resource, E>(&self, ev: &Result<watcher::Event<K>, E>) {
        match ev {
            Ok(watcher::Event::Delete(o)) => {
                self.clear(&super::shared::queue_key(o.namespace().as_deref(), &o.name_any()))
            }
            Ok(watcher::Event::Init) => self.lock().listing = true,
            Ok(watcher::Event::InitDone) => {
                let now = self.passed(Instant::now());
                let mut line = self.lock();
                line.listing = false;
                for key in std::mem::take(&mut line.parked) {
                    line.request(key, now);
                }
                drop(line);
                self.woken.notify_one();
            }
            _ => {}
        }
    }

    /// Sets aside the request of `key`, whose object the cache does not hold, if the primary
    /// watch lists again: the list may bring it. False: the object is gone.
    fn park(&self, key: Arc<str>) -> bool {
        let mut line = self.lock();
        if line.listing {
            line.parked.push(key);
        }
        line.listing
    }

    /// Takes up to `room` requests due at `now`, and says how long until the next one falls
    /// due (none: nothing waits, or no room is left).
    fn take(&self, now: Instant, room: usize) -> (Vec<Arc<str>>, Option<Duration>) {
        let passed = self.passed(now);
        let mut line = self.lock();
        let keys = line.take(passed, room);
        let wait = match room > keys.len() {
            true => line
                .order
                .first_key_value()
                .and_then(|((at, _), _)| self.until(*at, now)),
            false => None,
        };
        (keys, wait)
    }

    /// The end of `key`'s run at `now`, and what it asked for.
    fn done(&self, key: &str, now: Instant, action: Action) {
        let again = action.after.map(|after| self.due_after(now, after));
        self.lock().done(key, again);
    }

    /// Requests waiting (not running).
    #[cfg(test)]
    fn len(&self) -> usize {
        let line = self.lock();
        assert_eq!(line.due.len(), line.order.len());
        line.due.len()
    }
}

/// The key of `r` in the queue and the primary cache: a cluster-scoped kind's has no
/// namespace, whatever a mapper said.
fn key_of<K: Watchable>(r: &ObjectRef<K>) -> String {
    let namespace = r.namespace.as_deref().filter(|_| namespaced::<K>());
    super::shared::queue_key(namespace, &r.name)
}

/// Reconciles the objects of one watch scope as they are asked for: by the primary watch's
/// events and the other streams given ([`Controller::reconcile_on`]), and as each run asks.
pub(crate) struct Controller<K: kube::Resource<DynamicType = ()> + Clone + 'static> {
    cache: Cache<K>,
    queue: Arc<Queue>,
    concurrency: u16,
    requests: Vec<BoxStream<'static, ObjectRef<K>>>,
    all: Vec<BoxStream<'static, ()>>,
    shutdown: Option<BoxFuture<'static, ()>>,
    ready: Option<BoxFuture<'static, ()>>,
    metrics: Option<crate::metrics::Queue>,
}

impl<K: Watchable> Controller<K> {
    /// Reconciles the objects `cache` holds, at most `concurrency` at once (0: no limit).
    pub(crate) fn new(cache: Cache<K>, queue: Arc<Queue>, concurrency: u16) -> Self {
        Controller {
            cache,
            queue,
            concurrency,
            requests: Vec::new(),
            all: Vec::new(),
            shutdown: None,
            ready: None,
            metrics: None,
        }
    }

    /// Tells the work-queue metrics of the requests dropped for an object that is gone (a
    /// worker never takes them).
    pub(crate) fn with_metrics(mut self, metrics: crate::metrics::Queue) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// Hands nothing out until `ready` (the caches' first lists) completes: until then the
    /// primary cache may not hold an object a request names, which would drop the request.
    /// Requests are taken in and merged meanwhile.
    pub(crate) fn ready_on(mut self, ready: impl Future<Output = ()> + Send + 'static) -> Self {
        self.ready = Some(ready.boxed());
        self
    }

    /// Reconciles each object `requests` names, now.
    pub(crate) fn reconcile_on(
        mut self,
        requests: impl Stream<Item = ObjectRef<K>> + Send + 'static,
    ) -> Self {
        self.requests.push(requests.boxed());
        self
    }

    /// Reconciles every cached object at each item of `all`.
    pub(crate) fn reconcile_all_on(mut self, all: impl Stream<Item = ()> + Send + 'static) -> Self {
        self.all.push(all.boxed());
        self
    }

    /// Once `signal` fires, starts nothing new and ends when the runs under way have.
    pub(crate) fn graceful_shutdown_on(mut self, signal: impl Future<Output = ()> + Send + 'static) -> Self {
        self.shutdown = Some(signal.boxed());
        self
    }

    /// Runs `reconcile` on each object as it falls due; `error_policy` says what a failed
    /// run asks for next. Ends after the shutdown signal (never without one).
    pub(crate) async fn run<F, Fut, E>(self, reconcile: F, error_policy: impl Fn(&K, &E) -> Action)
    where
        F: Fn(Arc<K>) -> Fut,
        Fut: Future<Output = Result<Action, E>>,
    {
        let Controller {
            cache,
            queue,
            concurrency,
            requests,
            all,
            shutdown,
            ready,
            metrics,
        } = self;
        let mut ready = ready;
        let mut requests = futures::stream::select_all(requests);
        let mut all = futures::stream::select_all(all);
        let (mut requests_open, mut all_open) = (!requests.is_empty(), !all.is_empty());
        let mut shutdown = shutdown.unwrap_or_else(|| futures::future::pending().boxed());
        let mut stopping = false;
        let (reconcile, error_policy) = (&reconcile, &error_policy);
        // `reconcile` is called as the copy is handed out (what it does before its first
        // await happens then), not when the run is first polled.
        let run_one = |key: Arc<str>, obj: Arc<K>| {
            let run = reconcile(obj.clone());
            async move {
                let action = match run.await {
                    Ok(action) => action,
                    Err(e) => error_policy(&obj, &e),
                };
                (key, action)
            }
        };
        let mut running = FuturesUnordered::new();
        loop {
            let wait = loop {
                if stopping || ready.is_some() {
                    break None;
                }
                let room = match concurrency {
                    0 => usize::MAX,
                    n => usize::from(n).saturating_sub(running.len()),
                };
                let (keys, wait) = queue.take(Instant::now(), room);
                if keys.is_empty() {
                    break wait;
                }
                for key in keys {
                    match cache.get_key(&key) {
                        Some(obj) => running.push(run_one(key, obj)),
                        // Deleted since it was asked for, or not yet in a list under way.
                        None => {
                            queue.done(&key, Instant::now(), Action::await_change());
                            let parked = queue.park(key.clone());
                            if let Some(m) = metrics.as_ref().filter(|_| !parked) {
                                m.dropped(&key);
                            }
                        }
                    }
                }
            };
            if stopping && running.is_empty() {
                return;
            }
            tokio::select! {
                Some((key, action)) = running.next(), if !running.is_empty() => {
                    queue.done(&key, Instant::now(), action);
                    // A request that came during the run (often a watch event of one of the
                    // run's own writes) runs again once every task ready now has had its
                    // turn: the caches then hold the events of the run's other writes too, and
                    // the next run does not redo what they show done.
                    tokio::task::yield_now().await;
                }
                r = requests.next(), if requests_open && !stopping => {
                    // Every request ready now, before any is handed out: those for one
                    // object merge into one run.
                    let (now, mut next) = (Instant::now(), Some(r));
                    while let Some(r) = next {
                        match r {
                            Some(r) => queue.request(&key_of(&r), now, Duration::ZERO),
                            None => requests_open = false,
                        }
                        next = requests_open.then(|| requests.next().now_or_never()).flatten();
                    }
                }
                a = all.next(), if all_open && !stopping => match a {
                    Some(()) => {
                        let now = Instant::now();
                        cache.keys().iter().for_each(|key| queue.request(key, now, Duration::ZERO));
                    }
                    None => all_open = false,
                },
                _ = tokio::time::sleep(wait.unwrap_or_default()), if wait.is_some() => {}
                _ = queue.woken.notified(), if !stopping => {}
                _ = async {
                    if let Some(r) = ready.as_mut() {
                        r.await;
                    }
                }, if ready.is_some() => ready = None,
                _ = &mut shutdown, if !stopping => stopping = true,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;

    fn keys(keys: &[Arc<str>]) -> Vec<&str> {
        let mut v: Vec<&str> = keys.iter().map(|k| &**k).collect();
        v.sort();
        v
    }

    #[test]
    fn a_request_falls_due_at_its_millisecond_and_the_earliest_one_counts() {
        let q = Queue::new();
        let t0 = q.start;
        assert_eq!(q.take(t0, 10), (vec![], None), "nothing waits");
        q.request("a/one", t0, Duration::from_secs(3600));
        q.request("a/two", t0, Duration::from_secs(600));
        q.request("/cluster", t0, Duration::from_secs(120));
        // Asked for again, later: the earlier request stands; sooner: it replaces it.
        q.request("a/two", t0, Duration::from_secs(900));
        q.request("a/one", t0, Duration::from_secs(300));
        assert_eq!(q.len(), 3);
        let (due, wait) = q.take(t0 + Duration::from_secs(60), 10);
        assert!(due.is_empty());
        assert_eq!(wait, Some(Duration::from_secs(60)), "the earliest is /cluster's");
        let (due, _) = q.take(t0 + Duration::from_secs(120), 10);
        assert_eq!(keys(&due), ["/cluster"]);
        assert_eq!(keys(&q.take(t0 + Duration::from_secs(300), 10).0), ["a/one"]);
        assert_eq!(keys(&q.take(t0 + Duration::from_secs(600), 10).0), ["a/two"]);
        // Asked for partway through a millisecond: due once that millisecond has passed.
        let t = t0 + Duration::from_micros(700_300_400);
        q.request("a/late", t, Duration::from_secs(60));
        let early = t0 + Duration::from_micros(760_300_900);
        assert_eq!(
            q.take(early, 10),
            (vec![], Some(Duration::from_micros(100))),
            "early"
        );
        assert_eq!(
            keys(&q.take(t0 + Duration::from_millis(760_301), 10).0),
            ["a/late"]
        );
        // Due at one millisecond: first come, first served.
        for name in ["b/3", "b/1", "b/2"] {
            q.request(name, t0, Duration::ZERO);
        }
        let (due, _) = q.take(t0 + Duration::from_secs(800), 2);
        assert_eq!(due.iter().map(|k| &**k).collect::<Vec<_>>(), ["b/3", "b/1"]);
        // A wait longer than time can say never falls due, and nothing overflows.
        q.request("a/never", t0, Duration::MAX);
        assert_eq!(q.len(), 1, "b/2 waits");
    }

    #[test]
    fn an_object_runs_once_at_a_time_and_a_request_that_came_meanwhile_runs_after() {
        let q = Queue::new();
        let t0 = q.start;
        q.request("a/one", t0, Duration::ZERO);
        assert_eq!(keys(&q.take(t0, 10).0), ["a/one"]);
        // Asked for again during its run: held, not handed out twice.
        q.request("a/one", t0, Duration::ZERO);
        assert_eq!(q.take(t0 + Duration::from_secs(1), 10), (vec![], None));
        // Its run asks for an hour from now; the request that came meanwhile is sooner.
        q.done(
            "a/one",
            t0 + Duration::from_secs(1),
            Action::requeue(Duration::from_secs(3600)),
        );
        assert_eq!(keys(&q.take(t0 + Duration::from_secs(1), 10).0), ["a/one"]);
        // A run that asks for nothing leaves nothing behind.
        q.done("a/one", t0 + Duration::from_secs(2), Action::await_change());
        assert_eq!(q.len(), 0);
        assert_eq!(q.take(t0 + Duration::from_secs(7200), 10), (vec![], None));
    }

    #[test]
    fn no_more_runs_than_room_and_a_cleared_request_never_falls_due() {
        let q = Queue::new();
        let t0 = q.start;
        for name in ["a/1", "a/2", "a/3"] {
            q.request(name, t0, Duration::ZERO);
        }
        let (due, wait) = q.take(t0, 2);
        assert_eq!(due.len(), 2);
        assert_eq!(wait, None, "no room: the next waits for a run to end");
        q.request("b/later", t0, Duration::from_secs(90));
        q.clear("b/later");
        let (due, wait) = q.take(t0, 5);
        assert_eq!(due.len(), 1);
        assert_eq!(wait, None, "b/later was cleared");
        // Cleared while running: the request that came meanwhile goes too.
        q.request(&due[0], t0, Duration::ZERO);
        q.clear(&due[0]);
        q.done(&due[0], t0, Action::await_change());
        assert_eq!(q.len(), 0);
    }

    fn cm(ns: &str, name: &str) -> ConfigMap {
        let mut c = ConfigMap::default();
        c.metadata.namespace = Some(ns.into());
        c.metadata.name = Some(name.into());
        c
    }

    #[tokio::test(start_paused = true)]
    async fn the_loop_merges_requests_runs_each_object_once_at_a_time_and_requeues_as_asked() {
        let watch = crate::Watch::<ConfigMap>::all().compact();
        let cache = Cache::from_objects(&watch, [cm("a", "one"), cm("a", "two")]);
        let (tx, rx) = futures::channel::mpsc::unbounded();
        let (stop, stopped) = futures::channel::oneshot::channel::<()>();
        let runs = Arc::new(Mutex::new(Vec::<(String, Duration)>::new()));
        let start = Instant::now();
        let controller = Controller::new(cache, Queue::new(), 1)
            .reconcile_on(rx)
            .graceful_shutdown_on(stopped.map(|_| ()));
        let log = runs.clone();
        let run = tokio::spawn(async move {
            controller
                .run(
                    |obj: Arc<ConfigMap>| {
                        let log = log.clone();
                        async move {
                            let name = obj.metadata.name.clone().unwrap_or_default();
                            log.lock().unwrap().push((name.clone(), start.elapsed()));
                            tokio::time::sleep(Duration::from_secs(1)).await;
                            match name.as_str() {
                                "one" => Ok(Action::requeue(Duration::from_secs(3600))),
                                _ => Err("failed"),
                            }
                        }
                    },
                    |_: &ConfigMap, _: &&str| Action::requeue(Duration::from_secs(10)),
                )
                .await
        });
        for name in ["one", "one", "two", "gone", "one"] {
            tx.unbounded_send(ObjectRef::new(name).within("a")).unwrap();
        }
        tokio::time::sleep(Duration::from_secs(3700)).await;
        let _ = stop.send(());
        tokio::time::timeout(Duration::from_secs(5), run)
            .await
            .expect("the loop ends at shutdown")
            .unwrap();
        let runs = runs.lock().unwrap().clone();
        let at = |name: &str| -> Vec<u64> {
            runs.iter()
                .filter(|(n, _)| n == name)
                .map(|(_, t)| t.as_secs())
                .collect()
        };
        // One at a time: "one" at 0, "two" after it at 1, then "two" every 11 s (10 s after
        // each failed run of 1 s) and "one" an hour after its first run ended.
        assert_eq!(at("one"), [0, 3601], "{runs:?}");
        let two = at("two");
        assert_eq!(&two[..3], [1, 12, 23], "{runs:?}");
        assert!(
            runs.iter().all(|(n, _)| n != "gone"),
            "an object not cached is not run"
        );
    }

    /// Runs `controller` with a reconcile that logs the names it is handed.
    fn spawn_logged(
        controller: Controller<ConfigMap>,
    ) -> (Arc<Mutex<Vec<String>>>, tokio::task::JoinHandle<()>) {
        let runs = Arc::new(Mutex::new(Vec::<String>::new()));
        let log = runs.clone();
        let run = tokio::spawn(controller.run(
            move |obj: Arc<ConfigMap>| {
                log.lock()
                    .unwrap()
                    .push(obj.metadata.name.clone().unwrap_or_default());
                async { Ok::<_, ()>(Action::await_change()) }
            },
            |_: &ConfigMap, _: &()| Action::await_change(),
        ));
        (runs, run)
    }

    #[tokio::test(start_paused = true)]
    async fn nothing_is_handed_out_before_the_first_list_ends_so_no_listed_object_is_dropped() {
        // The cache holds a listed object only once the list ends; its request came before.
        let (cache, mut writer) = Cache::<ConfigMap>::empty(true);
        let (tx, rx) = futures::channel::mpsc::unbounded();
        let (listed, ready) = futures::channel::oneshot::channel::<()>();
        let (stop, stopped) = futures::channel::oneshot::channel::<()>();
        let controller = Controller::new(cache, Queue::new(), 2)
            .ready_on(ready.map(|_| ()))
            .reconcile_on(rx)
            .graceful_shutdown_on(stopped.map(|_| ()));
        let (runs, run) = spawn_logged(controller);
        writer.apply(&kube::runtime::watcher::Event::Init);
        writer.apply(&kube::runtime::watcher::Event::InitApply(cm(
            "a",
            "changed-while-down",
        )));
        tx.unbounded_send(ObjectRef::new("changed-while-down").within("a"))
            .unwrap();
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(
            runs.lock().unwrap().is_empty(),
            "nothing runs before the list ends"
        );
        writer.apply(&kube::runtime::watcher::Event::InitDone);
        let _ = listed.send(());
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(*runs.lock().unwrap(), ["changed-while-down"]);
        let _ = stop.send(());
        tokio::time::timeout(Duration::from_secs(5), run)
            .await
            .unwrap()
            .unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_for_an_object_that_a_relist_brings_waits_for_the_list_and_runs() {
        use kube::runtime::watcher::Event;
        let (cache, mut writer) = Cache::<ConfigMap>::empty(true);
        writer.apply(&Event::Init);
        writer.apply(&Event::InitApply(cm("a", "old")));
        writer.apply(&Event::InitDone);
        let queue = Queue::new();
        let (tx, rx) = futures::channel::mpsc::unbounded();
        let (stop, stopped) = futures::channel::oneshot::channel::<()>();
        let controller = Controller::new(cache, queue.clone(), 2)
            .reconcile_on(rx)
            .graceful_shutdown_on(stopped.map(|_| ()));
        let (runs, run) = spawn_logged(controller);
        // The watch lists again (its connection was down past the server's history): the
        // cache swaps the list in at its end, and a listed object's request comes before.
        let follow = |ev: Event<ConfigMap>| queue.follow::<ConfigMap, ()>(&Ok(ev));
        follow(Event::Init);
        writer.apply(&Event::Init);
        writer.apply(&Event::InitApply(cm("a", "created-while-down")));
        for name in ["created-while-down", "deleted-while-down"] {
            tx.unbounded_send(ObjectRef::new(name).within("a")).unwrap();
        }
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(runs.lock().unwrap().is_empty(), "not cached yet: nothing runs");
        writer.apply(&Event::InitDone);
        follow(Event::InitDone);
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(
            *runs.lock().unwrap(),
            ["created-while-down"],
            "the listed object runs once the list is in; the one it lacks is dropped"
        );
        assert_eq!(queue.len(), 0);
        let _ = stop.send(());
        tokio::time::timeout(Duration::from_secs(5), run)
            .await
            .unwrap()
            .unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn the_reconcile_is_called_as_the_copy_is_handed_out_not_when_the_run_is_first_polled() {
        // What a reconcile does before its first await (the driver takes the object's status
        // writes in hand there) happens as the copy is handed out: a watch event that comes
        // between then and the run's first poll must find it done.
        let watch = crate::Watch::<ConfigMap>::all().compact();
        let cache = Cache::from_objects(&watch, [cm("a", "one"), cm("a", "two")]);
        let (tx, rx) = futures::channel::mpsc::unbounded();
        let (stop, stopped) = futures::channel::oneshot::channel::<()>();
        let controller = Controller::new(cache, Queue::new(), 2)
            .reconcile_on(rx)
            .graceful_shutdown_on(stopped.map(|_| ()));
        let steps = Arc::new(Mutex::new(Vec::<String>::new()));
        let log = steps.clone();
        let run = tokio::spawn(controller.run(
            move |obj: Arc<ConfigMap>| {
                let name = obj.metadata.name.clone().unwrap_or_default();
                log.lock().unwrap().push(format!("called {name}"));
                let log = log.clone();
                async move {
                    log.lock().unwrap().push(format!("polled {name}"));
                    Ok::<_, ()>(Action::await_change())
                }
            },
            |_: &ConfigMap, _: &()| Action::await_change(),
        ));
        // Both requests ready at once: both copies are handed out in one turn.
        for name in ["one", "two"] {
            tx.unbounded_send(ObjectRef::new(name).within("a")).unwrap();
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        let steps = steps.lock().unwrap().clone();
        assert_eq!(steps.len(), 4, "{steps:?}");
        assert!(
            steps[..2].iter().all(|s| s.starts_with("called")),
            "each reconcile was called as its copy was handed out, before any run was polled: {steps:?}"
        );
        let _ = stop.send(());
        tokio::time::timeout(Duration::from_secs(5), run)
            .await
            .unwrap()
            .unwrap();
    }
}
