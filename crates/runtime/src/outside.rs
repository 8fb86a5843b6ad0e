//! Things outside the cluster that a controller reads and changes: the databases and roles of
//! a server, the records of a DNS zone, the accounts of a SaaS.
//!
//! A controller declares an [`Outside`] source with [`crate::Watches::outside`]; opkit polls
//! it into an [`OutsideCache`], which `observe` reads as it reads a Kubernetes cache, and
//! reconciles the objects whose outside things changed. A plan never calls out: it asks for
//! an [`Act`] ([`crate::Plan::act`]), which opkit carries out after the plan's cluster writes,
//! only where writes are allowed (the leader; with sharding, the owner of the object), bounded
//! by the reconcile timeout, counted and traced, and then reads the thing again so the next
//! plan sees the result.
use std::any::{Any, TypeId};
use std::collections::BTreeMap;
use std::fmt::Debug;
use std::future::Future;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;

use crate::plan::{Act, Retry};

/// A kind of thing outside the cluster, and how to read and change it. Implemented once per
/// outside system by the controller's author; the only code of a controller that talks to
/// the outside world.
pub trait Outside: Send + Sync + 'static {
    /// Names one thing, e.g. a database name.
    type Key: Clone + Ord + Debug + Send + Sync + 'static;
    /// What is known of one thing: compared between reads to tell what changed.
    type State: Clone + PartialEq + Send + Sync + 'static;
    /// A change a plan may ask for. May hold secrets (a password to set): opkit never logs
    /// it, only [`Outside::action_name`] and the key.
    type Action: Send + Sync + 'static;

    /// Names the source in metrics, traces and messages, e.g. `postgres`.
    fn name(&self) -> &'static str;

    /// Everything there is, read in one go (one catalog query, one list call): what the
    /// poll fills the cache with. A failure (the server is down) makes every lookup of the
    /// cache fail with it until a read succeeds again.
    fn list(&self) -> impl Future<Output = Result<BTreeMap<Self::Key, Self::State>, Retry>> + Send;

    /// One thing (`None`: it does not exist), read right after opkit acted on it.
    fn read(&self, key: &Self::Key) -> impl Future<Output = Result<Option<Self::State>, Retry>> + Send;

    /// Carries `action` out on `key`. Must be idempotent: after a timeout or a lost reply it
    /// is asked for again.
    fn act(&self, key: &Self::Key, action: &Self::Action) -> impl Future<Output = Result<(), Retry>> + Send;

    /// A short name of `action` for metrics and messages, e.g. `create_database`.
    fn action_name(action: &Self::Action) -> &'static str;
}

impl Act {
    /// Asks opkit to carry `action` out on `key` of the source `O` that the controller
    /// declared ([`crate::Watches::outside`]).
    pub fn new<O: Outside>(key: O::Key, action: O::Action) -> Self {
        Act {
            source: TypeId::of::<O>(),
            name: O::action_name(&action),
            key: format!("{key:?}"),
            payload: Box::new((key, action)),
        }
    }

    /// The key and action, if this act is on a thing of `O`: what a plan's unit test checks.
    pub fn get<O: Outside>(&self) -> Option<(&O::Key, &O::Action)> {
        self.payload
            .downcast_ref::<(O::Key, O::Action)>()
            .map(|(k, a)| (k, a))
    }
}

/// What is known of the things of one source.
struct Known<O: Outside> {
    things: BTreeMap<O::Key, O::State>,
    /// Why the last read failed (`None` after a success).
    failure: Option<Retry>,
    /// Whether any read has finished, well or not.
    read: bool,
    /// Counts the reads after acts.
    epoch: u64,
    /// The things read again after an act, with the epoch of that read: a full read that
    /// started before it must not put back what it saw.
    touched: BTreeMap<O::Key, u64>,
}

/// Called with the key of a thing an act changed: reconciles the objects it belongs to.
type Notify<K> = Arc<dyn Fn(&K) + Send + Sync>;

/// The things of one [`Outside`] source as last read, for `observe`. Cheap to clone.
pub struct OutsideCache<O: Outside> {
    source: Arc<O>,
    known: Arc<RwLock<Known<O>>>,
    notify: Option<Notify<O::Key>>,
    soon: Arc<tokio::sync::Notify>,
    /// Whether a read was asked for since the last one started.
    wanted: Arc<std::sync::atomic::AtomicBool>,
}

impl<O: Outside> Clone for OutsideCache<O> {
    fn clone(&self) -> Self {
        OutsideCache {
            source: self.source.clone(),
            known: self.known.clone(),
            notify: self.notify.clone(),
            soon: self.soon.clone(),
            wanted: self.wanted.clone(),
        }
    }
}

/// How long a full read may take before it counts as failed.
const LIST_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a lookup says to wait when nothing has been read yet.
const NOT_READ_YET: Duration = Duration::from_secs(1);

/// How long a read asked for by [`OutsideCache::read_soon`] waits, so that the requests of
/// many objects make one read.
pub(crate) const SOON: Duration = Duration::from_secs(1);

impl<O: Outside> OutsideCache<O> {
    /// An empty cache of `source`, filled by opkit's polls (or by [`OutsideCache::poll`]).
    pub(crate) fn new(source: O) -> Self {
        OutsideCache {
            source: Arc::new(source),
            known: Arc::new(RwLock::new(Known {
                things: BTreeMap::new(),
                failure: None,
                read: false,
                epoch: 0,
                touched: BTreeMap::new(),
            })),
            notify: None,
            soon: Arc::new(tokio::sync::Notify::new()),
            wanted: Default::default(),
        }
    }

    /// Calls `notify` with the key of each thing an act changed.
    pub(crate) fn notifying(mut self, notify: impl Fn(&O::Key) + Send + Sync + 'static) -> Self {
        self.notify = Some(Arc::new(notify));
        self
    }

    fn known(&self) -> std::sync::RwLockReadGuard<'_, Known<O>> {
        self.known.read().unwrap_or_else(|p| p.into_inner())
    }

    fn known_mut(&self) -> std::sync::RwLockWriteGuard<'_, Known<O>> {
        self.known.write().unwrap_or_else(|p| p.into_inner())
    }

    /// The thing `key` as last read (`None`: it does not exist), or why the source cannot be
    /// read now: return that from `observe` (`Err(retry.into())`) and opkit shows it as a
    /// condition and tries again after its delay. A plan never decides from a source it
    /// could not read.
    pub fn get(&self, key: &O::Key) -> Result<Option<O::State>, Retry> {
        let known = self.known();
        Self::readable(&known)?;
        Ok(known.things.get(key).cloned())
    }

    /// Every thing as last read, or why the source cannot be read now.
    pub fn all(&self) -> Result<BTreeMap<O::Key, O::State>, Retry> {
        let known = self.known();
        Self::readable(&known)?;
        Ok(known.things.clone())
    }

    fn readable(known: &Known<O>) -> Result<(), Retry> {
        if let Some(failure) = &known.failure {
            return Err(failure.clone());
        }
        if !known.read {
            return Err(Retry::new(
                NOT_READ_YET,
                "Ready",
                false,
                "NotReadYet",
                "the outside system has not been read yet",
            ));
        }
        Ok(())
    }

    /// Asks for a full read within about a second instead of at the next interval: for
    /// `observe` when the cache cannot know a thing yet (a server named a moment ago that
    /// the last read did not include). Calls nothing itself; requests made before the read
    /// starts share it, and at most one read a second follows them.
    pub fn read_soon(&self) {
        self.wanted.store(true, std::sync::atomic::Ordering::SeqCst);
        self.soon.notify_one();
    }

    /// Polls every `every`, or [`SOON`] after [`OutsideCache::read_soon`], until `closed`;
    /// `changed` gets the keys each read found changed.
    pub(crate) async fn keep_read(
        &self,
        every: Duration,
        closed: impl Fn() -> bool,
        changed: impl Fn(&O::Key),
    ) {
        use std::sync::atomic::Ordering::SeqCst;
        while !closed() {
            let next = tokio::time::Instant::now() + every;
            loop {
                tokio::select! {
                    _ = tokio::time::sleep_until(next) => break,
                    _ = self.soon.notified() => {
                        // A wake-up left over from requests a read already served waits on.
                        if self.wanted.load(SeqCst) {
                            tokio::time::sleep(SOON).await;
                            break;
                        }
                    }
                }
            }
            self.wanted.store(false, SeqCst);
            for key in self.poll().await {
                changed(&key);
            }
        }
    }

    /// Reads every thing (`Outside::list`) into the cache; returns the keys that appeared,
    /// changed or went since the last successful read (none on the first).
    pub(crate) async fn poll(&self) -> Vec<O::Key> {
        let started = self.known().epoch;
        let listed = match tokio::time::timeout(LIST_TIMEOUT, self.source.list()).await {
            Ok(listed) => listed,
            Err(_) => Err(Retry::new(
                NOT_READ_YET,
                "Ready",
                false,
                "OutsideTimeout",
                format!("reading {} took longer than {LIST_TIMEOUT:?}", self.source.name()),
            )),
        };
        let mut known = self.known_mut();
        let first = !known.read;
        known.read = true;
        let mut things = match listed {
            Ok(things) => things,
            Err(failure) => {
                tracing::debug!(source = self.source.name(), %failure, "outside read failed");
                known.failure = Some(failure);
                return Vec::new();
            }
        };
        known.failure = None;
        // What an act read while this list was under way is newer than what the list saw.
        let newer: Vec<O::Key> = known
            .touched
            .iter()
            .filter(|(_, e)| **e > started)
            .map(|(k, _)| k.clone())
            .collect();
        for key in newer {
            match known.things.get(&key) {
                Some(state) => things.insert(key, state.clone()),
                None => things.remove(&key),
            };
        }
        known.touched.retain(|_, e| *e > started);
        let mut changed: Vec<O::Key> = things
            .iter()
            .filter(|(k, v)| known.things.get(k) != Some(v))
            .map(|(k, _)| k.clone())
            .collect();
        changed.extend(known.things.keys().filter(|k| !things.contains_key(k)).cloned());
        known.things = things;
        if first { Vec::new() } else { changed }
    }
}

/// Runs the acts on one source: what the driver holds per declared source.
pub(crate) trait Actor: Send + Sync {
    /// The source's name, for metrics.
    fn name(&self) -> &'static str;
    /// Carries `act` out, then reads its thing again into the cache; returns whether the
    /// thing changed.
    fn run(&self, act: Act) -> BoxFuture<'static, Result<bool, Retry>>;
}

impl<O: Outside> Actor for OutsideCache<O> {
    fn name(&self) -> &'static str {
        self.source.name()
    }

    fn run(&self, act: Act) -> BoxFuture<'static, Result<bool, Retry>> {
        let this = self.clone();
        async move {
            let payload: Box<dyn Any + Send + Sync> = act.payload;
            let Ok(payload) = payload.downcast::<(O::Key, O::Action)>() else {
                unreachable!("acts are looked up by their source's type")
            };
            let (key, action) = *payload;
            this.source.act(&key, &action).await?;
            let now = this.source.read(&key).await?;
            let changed = {
                let mut known = this.known_mut();
                let changed = known.things.get(&key) != now.as_ref();
                known.epoch += 1;
                let epoch = known.epoch;
                known.touched.insert(key.clone(), epoch);
                match now {
                    Some(state) => known.things.insert(key.clone(), state),
                    None => known.things.remove(&key),
                };
                changed
            };
            if changed && let Some(notify) = &this.notify {
                notify(&key);
            }
            Ok(changed)
        }
        .boxed()
    }
}

/// The sources a controller declared, by type: where its plans' acts go.
pub(crate) type Actors = BTreeMap<TypeId, Arc<dyn Actor>>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// Keys are names, states numbers; `down` makes every call fail.
    #[derive(Default)]
    struct Numbers {
        things: Mutex<BTreeMap<String, u32>>,
        down: std::sync::atomic::AtomicBool,
        /// Held by a test: a full read takes its snapshot, then waits for it.
        gate: Arc<tokio::sync::Mutex<()>>,
    }

    enum Set {
        To(u32),
        Drop,
    }

    impl Numbers {
        fn check(&self) -> Result<(), Retry> {
            if self.down.load(std::sync::atomic::Ordering::SeqCst) {
                return Err(Retry::new(Duration::from_secs(5), "Ready", false, "Down", "down"));
            }
            Ok(())
        }
    }

    impl Outside for Numbers {
        type Key = String;
        type State = u32;
        type Action = Set;

        fn name(&self) -> &'static str {
            "numbers"
        }

        async fn list(&self) -> Result<BTreeMap<String, u32>, Retry> {
            self.check()?;
            let snapshot = self.things.lock().unwrap().clone();
            let _wait = self.gate.lock().await;
            Ok(snapshot)
        }

        async fn read(&self, key: &String) -> Result<Option<u32>, Retry> {
            self.check()?;
            Ok(self.things.lock().unwrap().get(key).copied())
        }

        async fn act(&self, key: &String, action: &Set) -> Result<(), Retry> {
            self.check()?;
            let mut things = self.things.lock().unwrap();
            match action {
                Set::To(n) => things.insert(key.clone(), *n),
                Set::Drop => things.remove(key),
            };
            Ok(())
        }

        fn action_name(action: &Set) -> &'static str {
            match action {
                Set::To(_) => "set",
                Set::Drop => "drop",
            }
        }
    }

    #[tokio::test]
    async fn the_cache_fails_until_read_reports_changes_and_takes_in_what_an_act_did() {
        let cache = OutsideCache::new(Numbers::default());
        let before = cache.get(&"a".into()).expect_err("nothing read yet");
        assert_eq!(before.reason, "NotReadYet");
        cache.source.things.lock().unwrap().insert("a".into(), 1);
        assert!(cache.poll().await.is_empty(), "the first read changes nothing");
        assert_eq!(cache.get(&"a".into()), Ok(Some(1)));
        assert_eq!(cache.get(&"b".into()), Ok(None));

        let act = Act::new::<Numbers>("b".into(), Set::To(2));
        assert_eq!(act.get::<Numbers>().map(|(k, _)| k.as_str()), Some("b"));
        assert_eq!(act.describe(), "set \"b\"");
        assert_eq!(cache.run(act).await, Ok(true), "b was created");
        assert_eq!(cache.get(&"b".into()), Ok(Some(2)), "read again after the act");
        assert_eq!(
            cache.run(Act::new::<Numbers>("b".into(), Set::To(2))).await,
            Ok(false)
        );

        // Changed by hand, and dropped by hand: both show in the next poll.
        {
            let mut things = cache.source.things.lock().unwrap();
            things.insert("a".into(), 7);
            things.remove("b");
        }
        assert_eq!(cache.poll().await, vec!["a".to_string(), "b".to_string()]);
        assert!(cache.poll().await.is_empty());

        // A full read taken before an act, finishing after it, does not put back what it saw.
        let gate = cache.source.gate.clone().lock_owned().await;
        let polling = tokio::spawn({
            let cache = cache.clone();
            async move { cache.poll().await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(
            cache.run(Act::new::<Numbers>("c".into(), Set::To(3))).await,
            Ok(true)
        );
        drop(gate);
        assert!(polling.await.expect("the poll").is_empty());
        assert_eq!(cache.get(&"c".into()), Ok(Some(3)), "the act's read stays");

        cache.source.down.store(true, std::sync::atomic::Ordering::SeqCst);
        assert!(cache.poll().await.is_empty());
        assert_eq!(cache.get(&"a".into()).map_err(|r| r.reason), Err("Down"));
        let failed = cache.run(Act::new::<Numbers>("a".into(), Set::Drop)).await;
        assert_eq!(failed.map_err(|r| r.reason), Err("Down"));
        cache
            .source
            .down
            .store(false, std::sync::atomic::Ordering::SeqCst);
        cache.poll().await;
        assert_eq!(cache.get(&"a".into()), Ok(Some(7)), "readable again");
    }

    #[tokio::test]
    async fn read_soon_reads_before_the_interval_and_requests_share_a_read() {
        let cache = OutsideCache::new(Numbers::default());
        cache.poll().await;
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let polling = tokio::spawn({
            let cache = cache.clone();
            async move {
                cache
                    .keep_read(
                        Duration::from_secs(3600),
                        || false,
                        |k: &String| {
                            let _ = tx.send(k.clone());
                        },
                    )
                    .await
            }
        });
        cache.source.things.lock().unwrap().insert("new".into(), 1);
        // The poller waits already: the first request wakes it, the others find it waking.
        tokio::task::yield_now().await;
        for _ in 0..10 {
            cache.read_soon();
        }
        let seen = tokio::time::timeout(SOON * 5, rx.recv()).await;
        assert_eq!(
            seen.ok().flatten().as_deref(),
            Some("new"),
            "read within seconds, not the hour"
        );
        assert_eq!(cache.get(&"new".into()), Ok(Some(1)));
        // Ten requests made one read: nothing more is read while nobody asks.
        cache.source.things.lock().unwrap().insert("later".into(), 2);
        let quiet = tokio::time::timeout(SOON * 3, rx.recv()).await;
        assert!(quiet.is_err(), "read again unasked: {quiet:?}");
        polling.abort();
    }
}
