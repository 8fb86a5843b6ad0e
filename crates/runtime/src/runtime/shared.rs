//! What the controllers of one manager share: the reflectors and stores of identical watches,
//! the record of opkit's own writes whose watch events are only echoes, and the count of
//! watch streams still waiting for their initial list.
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use kube::runtime::watcher;
use kube::{Resource, ResourceExt};
use tokio::sync::watch;

use crate::cache::{Cache, TrimKey};
use crate::expiring::Expiring;

/// What the work-queue metrics know an object by; the same at both ends of the queue.
pub(crate) fn queue_key(namespace: Option<&str>, name: &str) -> String {
    format!("{}/{name}", namespace.unwrap_or(""))
}

/// What a line of requests (the fair line) hands over as it falls due:
/// `take` gives the requests due now, or how long until one may be (none: until one is added,
/// which notifies `wake`); a notification looks again before that.
pub(crate) fn due<S, T>(
    line: Arc<S>,
    wake: fn(&S) -> &tokio::sync::Notify,
    take: impl Fn(&S) -> Result<Vec<T>, Option<Duration>> + Send + Sync + 'static,
) -> impl futures::Stream<Item = T> + Send + 'static
where
    S: Send + Sync + 'static,
    T: Send + 'static,
{
    use futures::StreamExt;
    let take = Arc::new(take);
    futures::stream::unfold(line, move |line| {
        let take = take.clone();
        async move {
            loop {
                match take(&line) {
                    Ok(due) => return Some((futures::stream::iter(due), line)),
                    Err(None) => wake(&line).notified().await,
                    Err(Some(after)) => {
                        let _ = tokio::time::timeout(after, wake(&line).notified()).await;
                    }
                }
            }
        }
    })
    .flatten()
}

/// Counts the watch streams of one controller that have not yet delivered their initial list.
#[derive(Clone)]
pub(crate) struct Synced {
    pending: Arc<AtomicUsize>,
    ready: Arc<AtomicBool>,
    /// A sharded controller of a spare (no slot claimed): nothing to list yet, ready.
    spare: Arc<AtomicBool>,
    tx: Arc<watch::Sender<bool>>,
}

impl Synced {
    pub(crate) fn new(ready: Arc<AtomicBool>) -> Self {
        Synced {
            pending: Arc::default(),
            ready,
            spare: Arc::default(),
            tx: Arc::new(watch::channel(false).0),
        }
    }

    /// A new stream to wait for; call the returned closure on each of its events.
    pub(super) fn track<C>(
        &self,
    ) -> impl FnMut(&kube::Result<watcher::Event<C>, watcher::Error>) + Send + 'static + use<C> {
        self.pending.fetch_add(1, Ordering::SeqCst);
        let this = self.clone();
        let mut seen = false;
        move |ev| {
            if !seen && matches!(ev, Ok(watcher::Event::InitDone)) {
                seen = true;
                this.done();
            }
        }
    }

    /// A first read to wait for (of an outside source); call the returned closure once it
    /// has finished, well or not.
    pub(super) fn track_once(&self) -> impl FnOnce() + Send + 'static {
        self.pending.fetch_add(1, Ordering::SeqCst);
        let this = self.clone();
        move || this.done()
    }

    /// One of the things waited for is there.
    fn done(&self) {
        if self.pending.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.ready.store(true, Ordering::SeqCst);
            self.tx.send_replace(true);
        }
    }

    /// Whether every stream has delivered its initial list.
    pub(crate) fn is_synced(&self) -> bool {
        *self.tx.borrow()
    }

    /// Marks the controller as one waiting for a sharding slot (ready: it has nothing to
    /// serve), or no longer.
    pub(crate) fn set_spare(&self, spare: bool) {
        self.spare.store(spare, Ordering::SeqCst);
        if spare {
            self.ready.store(true, Ordering::SeqCst);
        }
    }

    /// What `/readyz` says of the controller on a replica that leads: its caches are filled,
    /// or it waits for a sharding slot and has none to fill.
    pub(crate) fn is_ready(&self) -> bool {
        self.spare.load(Ordering::SeqCst) || self.is_synced()
    }

    pub(crate) fn subscribe(&self) -> watch::Receiver<bool> {
        self.tx.subscribe()
    }
}

/// The resourceVersions opkit's own writes produced, until their watch events arrive: those
/// events only echo what a plan already decided, so they update the caches but trigger no
/// reconcile. An echo that arrives before its write is recorded simply triggers as any
/// change does.
#[derive(Clone, Default)]
pub(crate) struct Echoes {
    written: Arc<Mutex<Written>>,
}

/// By `kind/namespace/name`: the resourceVersion written, and when. Tens of thousands of
/// writes may be in flight.
type Written = Expiring<String, (String, Instant), 4097>;

/// Echoes not seen for this long are forgotten (their event was lost or merged into a relist).
const ECHO_TTL: Duration = Duration::from_secs(120);

fn echo_key(kind: &str, namespace: Option<&str>, name: &str) -> String {
    format!("{kind}/{}/{name}", namespace.unwrap_or(""))
}

impl Echoes {
    /// Remembers that this process wrote `resource_version` of the object.
    pub(crate) fn record(&self, kind: &str, namespace: Option<&str>, name: &str, resource_version: String) {
        let mut w = self.written.lock().unwrap_or_else(|p| p.into_inner());
        w.sweep(|_, (_, at)| at.elapsed() < ECHO_TTL);
        w.insert(
            echo_key(kind, namespace, name),
            (resource_version, Instant::now()),
        );
    }

    /// Whether `obj` is exactly what this process last wrote of it (and forgets that write).
    pub(super) fn is_echo<C: Resource>(&self, kind: &str, obj: &C) -> bool {
        let key = echo_key(kind, obj.meta().namespace.as_deref(), &obj.name_any());
        let mut w = self.written.lock().unwrap_or_else(|p| p.into_inner());
        match (w.get(&key), obj.resource_version()) {
            (Some((rv, _)), Some(seen)) if *rv == seen => {
                w.remove(&key);
                true
            }
            _ => false,
        }
    }
}

/// The watches of one manager, by what they watch: controllers that declare the same watch
/// get one reflector and one store between them, each with its own feed of the events (its
/// own filter, echoes and sync count).
#[derive(Clone, Default)]
pub(crate) struct SharedWatches {
    pub(super) inner: Arc<Mutex<SharedInner>>,
}

#[derive(Default)]
pub(super) struct SharedInner {
    pub(super) entries: HashMap<ShareKey, Box<dyn std::any::Any + Send>>,
    /// The reflectors to run, each feeding its store, indexes and subscribers.
    pub(super) drivers: Vec<BoxFuture<'static, ()>>,
}

/// What makes two watches the same: kind, namespace, selector and projection.
#[derive(Hash, PartialEq, Eq)]
pub(super) struct ShareKey {
    pub(super) kind: std::any::TypeId,
    pub(super) namespace: Option<String>,
    pub(super) labels: Option<String>,
    pub(super) fields: Option<String>,
    pub(super) trim: Option<TrimKey>,
    pub(super) applied: Option<String>,
    pub(super) optional: bool,
    pub(super) compact: bool,
}

pub(super) struct Shared<C: Resource<DynamicType = ()> + Clone + 'static> {
    pub(super) cache: Cache<C>,
    /// For an optional watch: whether its kind is served now.
    pub(super) active: Option<Arc<AtomicBool>>,
    pub(super) subscribers: Arc<Mutex<Subscribers<C>>>,
}

type Feed<C> = futures::channel::mpsc::UnboundedSender<watcher::Event<C>>;

/// The controllers fed by one shared watch, and where its list stands, so that one that
/// subscribes after the watch started (a controller that starts late, such as a sharded one
/// once it has a slot) still gets a whole list and its end: without them it would never count
/// the watch as synced, nor see the objects listed before it came.
pub(super) struct Subscribers<C: Resource<DynamicType = ()> + Clone + 'static> {
    /// Each feed, and whether it joined during a list (its objects are sent at the list's end).
    feeds: Vec<(Feed<C>, bool)>,
    /// `None` before the first list starts; `Some(true)` while listing; `Some(false)` listed.
    listing: Option<bool>,
}

impl<C: Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + 'static> Subscribers<C> {
    pub(super) fn new(first: Feed<C>) -> Self {
        Subscribers {
            feeds: vec![(first, false)],
            listing: None,
        }
    }

    /// Adds a feed, brought up to where the others are: a listed watch's objects as a list of
    /// its own; during a list, the list's start now and its objects at its end.
    pub(super) fn join(&mut self, feed: Feed<C>, store: &Cache<C>) {
        match self.listing {
            None => self.feeds.push((feed, false)),
            Some(true) => {
                let _ = feed.unbounded_send(watcher::Event::Init);
                self.feeds.push((feed, true));
            }
            Some(false) => {
                let _ = feed.unbounded_send(watcher::Event::Init);
                Self::replay(&feed, store);
                let _ = feed.unbounded_send(watcher::Event::InitDone);
                self.feeds.push((feed, false));
            }
        }
    }

    fn replay(feed: &Feed<C>, store: &Cache<C>) {
        for o in store.all() {
            let _ = feed.unbounded_send(watcher::Event::InitApply((*o).clone()));
        }
    }

    /// Sends `ev` to every feed; `store` has applied it already.
    pub(super) fn send(&mut self, ev: watcher::Event<C>, store: &Cache<C>) {
        self.feeds.retain(|(f, _)| !f.is_closed());
        match &ev {
            watcher::Event::Init => self.listing = Some(true),
            watcher::Event::InitDone => {
                self.listing = Some(false);
                for (feed, joined) in &mut self.feeds {
                    if std::mem::take(joined) {
                        Self::replay(feed, store);
                    }
                }
            }
            _ => {}
        }
        // A copy for every feed but the last, which takes the event.
        if let Some(((last, _), others)) = self.feeds.split_last() {
            for (f, _) in others {
                let _ = f.unbounded_send(ev.clone());
            }
            let _ = last.unbounded_send(ev);
        }
    }
}

impl SharedWatches {
    /// The reflectors declared so far, to run until shutdown.
    pub(crate) fn take_drivers(&self) -> Vec<BoxFuture<'static, ()>> {
        std::mem::take(&mut self.inner.lock().unwrap_or_else(|p| p.into_inner()).drivers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;
    use watcher::Event;

    fn cm(name: &str) -> ConfigMap {
        let mut c = ConfigMap::default();
        c.metadata.namespace = Some("ns".into());
        c.metadata.name = Some(name.into());
        c
    }

    /// What a feed has received so far, as `init`, `+name` (listed), `done`, `name` (applied).
    fn received(rx: &mut futures::channel::mpsc::UnboundedReceiver<Event<ConfigMap>>) -> Vec<String> {
        std::iter::from_fn(|| rx.try_recv().ok())
            .map(|ev| match ev {
                Event::Init => "init".to_string(),
                Event::InitApply(c) => format!("+{}", c.name_any()),
                Event::InitDone => "done".to_string(),
                Event::Apply(c) => c.name_any(),
                Event::Delete(c) => format!("-{}", c.name_any()),
            })
            .collect()
    }

    #[test]
    fn a_feed_that_joins_late_gets_a_whole_list_and_its_end() {
        for compact in [false, true] {
            joins_late(compact);
        }
    }

    fn joins_late(compact: bool) {
        let (store, mut writer) = Cache::<ConfigMap>::empty(compact);
        let mut step = |subs: &mut Subscribers<ConfigMap>, ev: Event<ConfigMap>| {
            writer.apply(&ev);
            subs.send(ev, &store);
        };
        let (first, mut first_rx) = futures::channel::mpsc::unbounded();
        let mut subs = Subscribers::new(first);
        let (early, mut early_rx) = futures::channel::mpsc::unbounded();
        subs.join(early, &store);
        step(&mut subs, Event::Init);
        step(&mut subs, Event::InitApply(cm("a")));
        let (during, mut during_rx) = futures::channel::mpsc::unbounded();
        subs.join(during, &store);
        step(&mut subs, Event::InitApply(cm("b")));
        step(&mut subs, Event::InitDone);
        let (after, mut after_rx) = futures::channel::mpsc::unbounded();
        subs.join(after, &store);
        step(&mut subs, Event::Apply(cm("c")));

        let whole = ["init", "+a", "+b", "done", "c"];
        assert_eq!(received(&mut first_rx), whole);
        assert_eq!(
            received(&mut early_rx),
            whole,
            "joined before the list: as the first"
        );
        let mut during = received(&mut during_rx);
        assert_eq!(
            during[..2],
            ["init", "+b"],
            "the list's start at once, then its rest"
        );
        during[2..4].sort();
        assert_eq!(
            during[2..],
            ["+a", "+b", "done", "c"],
            "every listed object before the end"
        );
        let mut after = received(&mut after_rx);
        after[1..3].sort();
        assert_eq!(after, whole, "joined a listed watch: a list of its own at once");
    }
}
