//! Wake-ups far away: a plan's `Requeue::After` of minutes or hours (the usual safety-net
//! resync), kept here as one small entry per object instead of in kube-runtime's scheduler.
//!
//! kube-runtime keeps each scheduled reconcile as a request (the object's reference, with its
//! four strings, and the reason) in a delay queue and again in a map beside it: about half a
//! KiB per object, held for the whole hour by every object of a settled operator. Here an
//! object's wake-up is its `namespace/name`, shared by a map and an ordered set, and the
//! millisecond it falls due: about a quarter of that. A wake-up is never early and at most a
//! millisecond late (a schedule that starts a job at its minute must not slip a second).
//!
//! Each reconcile of an object replaces its wake-up (clears it when it starts, sets the new
//! one when its plan asks for one), as a reconcile replaces what kube-runtime had scheduled;
//! a deleted object's goes with it.
use std::collections::{BTreeSet, HashMap};
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::Stream;
use kube::Resource;
use kube::runtime::reflector::ObjectRef;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::cache::object_ref;

/// Requeues this far away or further wait here; nearer ones stay kube-runtime's.
pub(crate) const FAR: Duration = Duration::from_secs(60);

/// The far wake-ups of one controller's watch scope.
pub(crate) struct Wakeups<K> {
    inner: Mutex<Inner>,
    /// A wake-up earlier than any before it was set.
    wake: Notify,
    start: Instant,
    kind: PhantomData<fn() -> K>,
}

#[derive(Default)]
struct Inner {
    /// When each object wakes, in milliseconds since `start`.
    due: HashMap<Arc<str>, u64>,
    /// The same wake-ups, earliest first.
    order: BTreeSet<(u64, Arc<str>)>,
}

impl<K: Resource<DynamicType = ()>> Wakeups<K> {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Wakeups {
            inner: Mutex::default(),
            wake: Notify::new(),
            start: Instant::now(),
            kind: PhantomData,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The millisecond (since `start`) at or after `at`: when a wake-up for `at` falls due
    /// (none: later than an `Instant` can say).
    fn due_at(&self, at: Option<Instant>) -> u64 {
        let Some(at) = at else { return u64::MAX };
        let d = at.saturating_duration_since(self.start);
        let ms = d.as_millis() + u128::from(d.subsec_nanos() % 1_000_000 > 0);
        u64::try_from(ms).unwrap_or(u64::MAX)
    }

    /// The milliseconds (since `start`) that have passed at `now`: the wake-ups due by then.
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

    /// Wakes the object of `key` (`namespace/name`) `after` from `now`, instead of any wake-up
    /// it had.
    pub(crate) fn set(&self, key: &str, now: Instant, after: Duration) {
        let at = self.due_at(now.checked_add(after));
        let mut inner = self.lock();
        let earliest = inner.order.first().map(|(first, _)| *first);
        let key = match inner.due.remove_entry(key) {
            Some((key, old)) => {
                inner.order.remove(&(old, key.clone()));
                key
            }
            None => key.into(),
        };
        inner.due.insert(key.clone(), at);
        inner.order.insert((at, key));
        if earliest.is_none_or(|earliest| at < earliest) {
            drop(inner);
            self.wake.notify_one();
        }
    }

    /// Forgets the wake-up of `key`, if it has one.
    pub(crate) fn clear(&self, key: &str) {
        let mut inner = self.lock();
        if let Some((key, at)) = inner.due.remove_entry(key) {
            inner.order.remove(&(at, key));
        }
    }

    /// Wake-ups waiting.
    #[cfg(test)]
    fn len(&self) -> usize {
        let inner = self.lock();
        assert_eq!(inner.due.len(), inner.order.len());
        inner.due.len()
    }

    /// Takes the wake-ups due at `now`; or, when none is, how long until one is (none: wait
    /// for one to be set).
    fn take(&self, now: Instant) -> Result<Vec<ObjectRef<K>>, Option<Duration>> {
        let passed = self.passed(now);
        let mut inner = self.lock();
        let mut refs = Vec::new();
        while inner.order.first().is_some_and(|(at, _)| *at <= passed) {
            if let Some((_, key)) = inner.order.pop_first() {
                inner.due.remove(&key);
                refs.push(object_ref(&key));
            }
        }
        if refs.is_empty() {
            let next = inner.order.first().map(|(at, _)| *at);
            return Err(next.and_then(|at| self.until(at, now)));
        }
        Ok(refs)
    }

    /// The objects as their wake-ups fall due: for kube-runtime's `reconcile_on`.
    pub(crate) fn feed(self: Arc<Self>) -> impl Stream<Item = ObjectRef<K>> + Send + 'static
    where
        K: 'static,
    {
        super::shared::due(self, |w| &w.wake, |w| w.take(Instant::now()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;
    use k8s_openapi::api::core::v1::ConfigMap;

    fn names(refs: &[ObjectRef<ConfigMap>]) -> Vec<String> {
        let mut v: Vec<String> = refs
            .iter()
            .map(|r| format!("{}/{}", r.namespace.clone().unwrap_or_default(), r.name))
            .collect();
        v.sort();
        v
    }

    #[test]
    fn a_wake_up_falls_due_at_its_millisecond_and_only_the_last_one_set_counts() {
        let w = Wakeups::<ConfigMap>::new();
        let t0 = w.start;
        assert_eq!(w.take(t0).unwrap_err(), None, "nothing waits");
        w.set("a/one", t0, Duration::from_secs(3600));
        w.set("a/two", t0, Duration::from_secs(120));
        w.set("/cluster", t0, Duration::from_secs(120));
        // Set again by a later reconcile: the earlier wake-up is gone.
        w.set("a/two", t0, Duration::from_secs(600));
        assert_eq!(w.len(), 3);
        let wait = w.take(t0 + Duration::from_secs(60)).unwrap_err();
        assert_eq!(wait, Some(Duration::from_secs(60)), "the earliest is /cluster's");
        let due = w.take(t0 + Duration::from_secs(120)).unwrap();
        assert_eq!(names(&due), ["/cluster"]);
        assert_eq!(due[0].namespace, None, "a cluster-scoped object has no namespace");
        assert!(
            w.take(t0 + Duration::from_secs(599)).is_err(),
            "a/two's first wake-up was replaced"
        );
        assert_eq!(names(&w.take(t0 + Duration::from_secs(600)).unwrap()), ["a/two"]);
        // Set partway through a millisecond: due once that millisecond has passed, not before.
        let t = t0 + Duration::from_micros(700_300_400);
        w.set("a/late", t, Duration::from_secs(60));
        let early = t0 + Duration::from_micros(760_300_900);
        assert_eq!(
            w.take(early).unwrap_err(),
            Some(Duration::from_micros(100)),
            "early"
        );
        let due = w.take(t0 + Duration::from_millis(760_301)).unwrap();
        assert_eq!(names(&due), ["a/late"]);
        // A wait longer than time can say waits for ever, and nothing overflows.
        w.set("a/never", t0, Duration::MAX);
        assert_eq!(names(&w.take(t0 + Duration::from_secs(7200)).unwrap()), ["a/one"]);
        assert_eq!(w.len(), 1);
        assert_eq!(w.take(t0 + Duration::from_secs(7200)).unwrap_err(), None);
        w.clear("a/never");
        assert_eq!(w.len(), 0);
    }

    #[test]
    fn a_cleared_wake_up_never_falls_due() {
        let w = Wakeups::<ConfigMap>::new();
        let t0 = w.start;
        w.set("a/one", t0, Duration::from_secs(60));
        w.set("a/two", t0, Duration::from_secs(90));
        w.clear("a/one");
        // The earliest was cleared: at its time nothing is due, and the next is a/two's.
        let wait = w.take(t0 + Duration::from_secs(60)).unwrap_err();
        assert_eq!(wait, Some(Duration::from_secs(30)));
        assert_eq!(names(&w.take(t0 + Duration::from_secs(90)).unwrap()), ["a/two"]);
        w.set("a/three", t0, Duration::from_secs(100));
        w.clear("a/three");
        assert_eq!(w.take(t0 + Duration::from_secs(100)).unwrap_err(), None);
    }

    #[tokio::test(start_paused = true)]
    async fn the_feed_hands_over_each_object_when_it_falls_due_and_waits_for_new_ones() {
        let w = Wakeups::<ConfigMap>::new();
        let mut feed = Box::pin(w.clone().feed());
        let now = Instant::now();
        w.set("a/later", now, Duration::from_secs(300));
        w.set("a/sooner", now, Duration::from_secs(100));
        let first = feed.next().await.expect("a wake-up");
        assert_eq!(first.name, "sooner");
        assert!(now.elapsed() >= Duration::from_secs(100) && now.elapsed() < Duration::from_secs(102));
        // One set while the feed waits for a later one, earlier than it, wakes it.
        let (w2, set_at) = (w.clone(), Instant::now());
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(10)).await;
            w2.set("a/new", Instant::now(), Duration::from_secs(60));
        });
        let second = feed.next().await.expect("a wake-up");
        assert_eq!(second.name, "new");
        let waited = set_at.elapsed();
        assert!(
            waited >= Duration::from_secs(70) && waited < Duration::from_secs(72),
            "{waited:?}"
        );
        assert_eq!(feed.next().await.expect("a wake-up").name, "later");
        assert!(now.elapsed() >= Duration::from_secs(300) && now.elapsed() < Duration::from_secs(302));
    }
}
