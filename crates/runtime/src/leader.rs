//! Leader election on a `coordination.k8s.io` Lease, so that of several replicas only one
//! reconciles, and a [`WriteGate`] so that a leader that was frozen or cut off writes nothing
//! once its lease may have passed to another replica.
//!
//! Same protocol and defaults as client-go's leaderelection (15 s lease, 10 s renew deadline,
//! 2 s retry), made safe against overlap:
//! - every renewal is bounded by the time left to the deadline, counted from when the last
//!   successful renewal was *sent* (not when its answer came back);
//! - a standby judges expiry by its own monotonic clock, from when it last saw the record
//!   change, never by comparing the holder's `renewTime` with its wall clock (clock skew);
//! - transient API errors are retried within the deadline instead of ending the process;
//! - the gate every write passes closes at `last renewal sent + renew deadline`, which is at
//!   least `lease duration − renew deadline` before any standby may take over.
//!
//! Differences from client-go besides: a standby waits on a watch of the Lease instead of
//! polling, a leader that stops releases the Lease, so a standby takes over at once, and a
//! leader that loses the Lease may stand by again in the same process (client-go's callers
//! exit), treating a record that still names it as another's.
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{ObjectMeta, PostParams};
use kube::runtime::watcher;
use kube::{Api, Client, Config};
use tokio_util::sync::CancellationToken;

/// Where the Lease lives, who we are, and the timings.
#[derive(Clone, Debug)]
pub struct LeaderElectionConfig {
    /// Namespace of the Lease.
    pub namespace: String,
    /// Name of the Lease; every replica of one operator must use the same.
    pub name: String,
    /// This replica's identity (unique per process), recorded as `holderIdentity`.
    pub identity: String,
    /// How long a Lease is valid after its last renewal; a standby takes over after that.
    pub lease_duration: Duration,
    /// A leader that could not renew for this long gives up (and exits, or stands by). The
    /// difference to the lease duration is the safety margin of the write gate.
    pub renew_deadline: Duration,
    /// How often the leader renews.
    pub retry_period: Duration,
    /// Labels of the Lease when this replica creates it (member Leases are found by them).
    pub labels: std::collections::BTreeMap<String, String>,
}

impl LeaderElectionConfig {
    /// client-go's defaults, with identity `<hostname>_<random>`: random because a restarted
    /// container keeps its hostname and its pid (1), and must not pass for the replica it
    /// replaces.
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        let host = std::env::var("POD_NAME")
            .or_else(|_| std::env::var("HOSTNAME"))
            .or_else(|_| std::fs::read_to_string("/etc/hostname").map(|s| s.trim().to_string()))
            .unwrap_or_else(|_| "opkit".into());
        LeaderElectionConfig {
            namespace: namespace.into(),
            name: name.into(),
            identity: format!("{host}_{:016x}", random()),
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
            labels: Default::default(),
        }
    }
}

/// The client configuration for leader election: no retry layer (a retried renewal could
/// outlive the deadline) and connect and write timeouts. Reads are bounded per request by the
/// time left to the deadline instead of a socket read timeout, which would also end the
/// standby's quiet watch of the Lease.
pub fn election_client_config(mut config: Config, cfg: &LeaderElectionConfig) -> Config {
    config.default_retry = false;
    config.connect_timeout = Some(cfg.retry_period);
    config.write_timeout = Some(cfg.renew_deadline);
    config
}

fn held_by(holder: &str) -> String {
    match holder {
        "" => "held by nobody (deleted or released by someone else)".into(),
        h => format!("held by {h:?}"),
    }
}

/// 64 random bits from the standard library's per-process hash seed and the clock.
fn random() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::UNIX_EPOCH
            .elapsed()
            .unwrap_or_default()
            .as_nanos(),
    );
    h.write_u32(std::process::id());
    h.finish()
}

/// Errors of leader election.
#[derive(Debug, thiserror::Error)]
#[allow(missing_docs)] // every variant says what failed in its message
pub enum LeaderError {
    #[error("reading or writing Lease {name}: {source}")]
    Api { name: String, source: kube::Error },
    #[error("leadership lost: Lease {name} not renewed within {deadline:?}")]
    Lost { name: String, deadline: Duration },
    #[error("leadership lost: Lease {name} is now {}", held_by(holder))]
    TakenOver { name: String, holder: String },
}

/// Whether this process may write: always without leader election; with it, only while the
/// lease it last renewed is valid with a margin, judged on the monotonic clock and on the wall
/// clock alike: the monotonic one keeps counting through a SIGSTOP but stops while the machine
/// is suspended, when the wall clock goes on. A process that was stopped, suspended or cut
/// off finds the gate closed when it runs again, before it learns anything from the
/// apiserver. (A wall clock stepped forward closes the gate early, until the next renewal.)
#[derive(Clone, Debug)]
pub struct WriteGate {
    inner: Arc<GateInner>,
}

#[derive(Debug)]
struct GateInner {
    base: Instant,
    enforced: AtomicBool,
    /// Nanoseconds after `base` until which writes may start; 0: closed.
    open_until: AtomicU64,
    /// The same moment on the wall clock, in nanoseconds since the Unix epoch.
    wall_until: AtomicU64,
    /// Nanoseconds between the gate closing and another replica taking over at the
    /// earliest (the Lease's duration less the renew deadline); 0: unknown.
    margin: AtomicU64,
    refused: AtomicU64,
}

/// A write refused because this process may no longer be the leader.
#[derive(Clone, Copy, Debug, thiserror::Error)]
#[error("not the leader (the lease this process renewed may have expired): write refused")]
pub struct NotLeader;

impl Default for WriteGate {
    fn default() -> Self {
        WriteGate {
            inner: Arc::new(GateInner {
                base: Instant::now(),
                enforced: AtomicBool::new(false),
                open_until: AtomicU64::new(0),
                wall_until: AtomicU64::new(0),
                margin: AtomicU64::new(0),
                refused: AtomicU64::new(0),
            }),
        }
    }
}

impl WriteGate {
    /// A gate that lets every write through until [`WriteGate::enforce`].
    pub fn new() -> Self {
        Self::default()
    }

    /// From now on writes pass only while a renewal holds the gate open.
    pub fn enforce(&self) {
        self.inner.open_until.store(0, Ordering::SeqCst);
        self.inner.enforced.store(true, Ordering::SeqCst);
    }

    /// Records how long after this gate closes another replica may take over at the earliest,
    /// for the write connections' TCP user timeout.
    pub(crate) fn set_margin(&self, margin: Duration) {
        self.inner.margin.store(nanos(margin), Ordering::SeqCst);
    }

    /// What [`WriteGate::set_margin`] recorded, if anything.
    pub(crate) fn margin(&self) -> Option<Duration> {
        match self.inner.margin.load(Ordering::SeqCst) {
            0 => None,
            n => Some(Duration::from_nanos(n)),
        }
    }

    /// Lets writes start until `until`.
    pub fn open_until(&self, until: Instant) {
        let left = until.saturating_duration_since(Instant::now());
        let ns = nanos(until.saturating_duration_since(self.inner.base)).max(1);
        self.inner
            .wall_until
            .store(wall_nanos().saturating_add(nanos(left)), Ordering::SeqCst);
        self.inner.open_until.store(ns, Ordering::SeqCst);
    }

    /// Refuses every write from now on.
    pub fn close(&self) {
        self.inner.open_until.store(0, Ordering::SeqCst);
    }

    /// `Ok` if a write may start now.
    pub fn check(&self) -> Result<(), NotLeader> {
        if !self.inner.enforced.load(Ordering::SeqCst) {
            return Ok(());
        }
        let until = self.inner.open_until.load(Ordering::SeqCst);
        let now = Instant::now()
            .saturating_duration_since(self.inner.base)
            .as_nanos();
        let wall_until = self.inner.wall_until.load(Ordering::SeqCst);
        if until != 0 && now < u128::from(until) && wall_nanos() < wall_until {
            Ok(())
        } else {
            self.inner.refused.fetch_add(1, Ordering::Relaxed);
            Err(NotLeader)
        }
    }

    /// Until when a write may still be in flight: `Ok(None)` without leader election (no
    /// limit), `Ok(Some(t))` while a renewal holds the gate open (counted as a pass), `Err`
    /// (counted as refused) while it is closed.
    pub fn deadline(&self) -> Result<Option<Instant>, NotLeader> {
        if !self.inner.enforced.load(Ordering::SeqCst) {
            return Ok(None);
        }
        let until = self.inner.open_until.load(Ordering::SeqCst);
        self.check()?;
        Ok(Some(self.inner.base + Duration::from_nanos(until)))
    }

    /// How many writes the gate refused.
    pub fn refused(&self) -> u64 {
        self.inner.refused.load(Ordering::Relaxed)
    }
}

/// Nanoseconds since the Unix epoch on the wall clock (0 before it).
fn wall_nanos() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(nanos)
        .unwrap_or(0)
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Acquires, renews and releases one Lease.
#[derive(Clone)]
pub struct LeaderElector {
    api: Api<Lease>,
    cfg: LeaderElectionConfig,
    gate: WriteGate,
    seen: Arc<std::sync::Mutex<Option<String>>>,
    /// Set once this replica has lost the Lease: from then on a record that still names it is
    /// treated as another's (waited out for its duration), as a restarted process would, so
    /// a replica whose renewals keep failing cannot keep taking the Lease back from a
    /// healthy standby.
    lost_once: Arc<AtomicBool>,
    /// The Lease as this replica last wrote it (the apiserver's answer, with its
    /// resourceVersion and uid): a renewal writes it again without reading first, and the
    /// apiserver refuses that write if anyone changed or deleted the Lease since.
    written: Arc<std::sync::Mutex<Option<Lease>>>,
}

fn now() -> MicroTime {
    MicroTime(Timestamp::now())
}

/// How long a Lease record holds from when it was last seen to change (`leaseDurationSeconds`;
/// none or negative: 0).
pub(crate) fn lease_duration(spec: &LeaseSpec) -> Duration {
    Duration::from_secs(u64::try_from(spec.lease_duration_seconds.unwrap_or(0)).unwrap_or(0))
}

/// Whether `lease` may be taken by `identity`: ours, or unchanged for its duration since
/// `seen_change` (on this process's monotonic clock) at `now`. That holds for a record naming
/// no holder too: a release sets a duration of 1 s after its holder closed its gate, while a
/// holder cleared by hand keeps the full duration, which the holder may still be writing in.
pub fn claimable(lease: &Lease, identity: &str, seen_change: Instant, now: Instant) -> bool {
    let Some(spec) = &lease.spec else { return true };
    match spec.holder_identity.as_deref() {
        Some(h) if !h.is_empty() && h == identity => true,
        _ => now.saturating_duration_since(seen_change) >= lease_duration(spec),
    }
}

/// The outcome of one renewal attempt.
enum Renewal {
    Held,
    TakenBy(String),
}

impl LeaderElector {
    /// An elector for `cfg`'s Lease. Give it a client from [`election_client_config`].
    pub fn new(client: Client, cfg: LeaderElectionConfig, gate: WriteGate) -> Self {
        gate.set_margin(cfg.lease_duration.saturating_sub(cfg.renew_deadline));
        LeaderElector {
            api: Api::namespaced(client, &cfg.namespace),
            cfg,
            gate,
            seen: Default::default(),
            lost_once: Default::default(),
            written: Default::default(),
        }
    }

    /// The holder this replica last saw while waiting to lead (`""`: nobody; `None`: no
    /// Lease seen yet), for status output and tests.
    pub fn holder_seen(&self) -> Option<String> {
        self.seen.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// This replica's identity.
    pub fn identity(&self) -> &str {
        &self.cfg.identity
    }

    fn err(&self, source: kube::Error) -> LeaderError {
        LeaderError::Api {
            name: self.cfg.name.clone(),
            source,
        }
    }

    fn lost(&self) -> LeaderError {
        self.lost_once.store(true, Ordering::SeqCst);
        LeaderError::Lost {
            name: self.cfg.name.clone(),
            deadline: self.cfg.renew_deadline,
        }
    }

    /// Writes us in as holder (taking over `live` if it is given). `Ok(false)`: someone else
    /// wrote first (a conflict), which is not an error.
    async fn write(&self, live: Option<Lease>) -> Result<bool, LeaderError> {
        let t = now();
        let duration = i32::try_from(self.cfg.lease_duration.as_secs()).unwrap_or(i32::MAX);
        let result = match live {
            None => {
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(self.cfg.name.clone()),
                        namespace: Some(self.cfg.namespace.clone()),
                        labels: (!self.cfg.labels.is_empty()).then(|| self.cfg.labels.clone()),
                        ..Default::default()
                    },
                    spec: Some(LeaseSpec {
                        holder_identity: Some(self.cfg.identity.clone()),
                        lease_duration_seconds: Some(duration),
                        acquire_time: Some(t.clone()),
                        renew_time: Some(t),
                        lease_transitions: Some(0),
                        ..Default::default()
                    }),
                };
                self.api.create(&PostParams::default(), &lease).await
            }
            Some(mut lease) => {
                let spec = lease.spec.get_or_insert_with(Default::default);
                if spec.holder_identity.as_deref() != Some(self.cfg.identity.as_str()) {
                    spec.holder_identity = Some(self.cfg.identity.clone());
                    spec.acquire_time = Some(t.clone());
                    spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
                }
                spec.lease_duration_seconds = Some(duration);
                spec.renew_time = Some(t);
                // `replace` carries the resourceVersion (and uid) we read or last wrote: a
                // concurrent writer makes it fail with 409 instead of two replicas both
                // believing they lead.
                self.api
                    .replace(&self.cfg.name, &PostParams::default(), &lease)
                    .await
            }
        };
        let mut written = self.written.lock().unwrap_or_else(|p| p.into_inner());
        match result {
            Ok(lease) => {
                *written = Some(lease);
                Ok(true)
            }
            Err(kube::Error::Api(s)) if s.code == 409 => {
                *written = None;
                Ok(false)
            }
            Err(e) => Err(self.err(e)),
        }
    }

    /// Waits until this replica holds the Lease and opens the gate; returns the renewal
    /// deadline to give [`LeaderElector::renew`], or `None` if `cancel` fired first. API errors
    /// are logged and retried.
    pub async fn acquire(&self, cancel: &CancellationToken) -> Result<Option<Instant>, LeaderError> {
        self.acquire_in_turn(cancel, None).await
    }

    /// [`LeaderElector::acquire`], its claims taking turns with those of the other electors
    /// sharing `turn` (true once one of them has won): of Leases sought together (sharding
    /// slots) one is claimed at a time and none after one is won, so a replica is named in
    /// only one of them.
    async fn acquire_in_turn(
        &self,
        cancel: &CancellationToken,
        turn: Option<&tokio::sync::Mutex<bool>>,
    ) -> Result<Option<Instant>, LeaderError> {
        let watch = || {
            let cfg = watcher::Config::default().fields(&format!("metadata.name={}", self.cfg.name));
            watcher(self.api.clone(), cfg).boxed()
        };
        let mut events = watch();
        // The watch's first list has no time limit of its own: one sent on a connection that
        // died (half-open) would wait forever, and this replica with it. It starts again
        // when it has not finished within a Lease duration.
        let mut listing_since = Instant::now();
        // The record as last seen, and when (monotonic) it was seen to change.
        let mut live: Option<Lease> = None;
        let mut seen_change = Instant::now();
        let mut synced = false;
        // A Lease deleted while another replica held it: that holder may not know yet and may
        // still write until its next renewal, so it is treated as held until its duration runs
        // out. (A graceful release empties the holder instead, after closing its gate.)
        let mut deleted_until: Option<Instant> = None;
        // The turn, kept after a claim whose outcome is unknown (it timed out, or failed
        // without a refusal): that claim may have landed, so no other Lease is claimed until
        // this one is seen again, naming us (claimed again at once) or another holder.
        let mut kept = None;
        let observe = |l: Option<Lease>,
                       live: &mut Option<Lease>,
                       seen_change: &mut Instant,
                       deleted_until: &mut Option<Instant>| {
            // The record (the spec) changes when its holder renews or another replica takes it.
            if l.as_ref().and_then(|l| l.spec.as_ref()) != live.as_ref().and_then(|l| l.spec.as_ref()) {
                *seen_change = Instant::now();
            }
            *deleted_until = match (&l, live.as_ref().and_then(|l| l.spec.as_ref())) {
                (None, Some(prev))
                    if prev
                        .holder_identity
                        .as_deref()
                        .is_some_and(|h| !h.is_empty() && h != self.cfg.identity) =>
                {
                    Some(Instant::now() + lease_duration(prev))
                }
                (None, None) => *deleted_until,
                _ => None,
            };
            *self.seen.lock().unwrap_or_else(|p| p.into_inner()) = l.as_ref().map(|l| {
                l.spec
                    .as_ref()
                    .and_then(|s| s.holder_identity.clone())
                    .unwrap_or_default()
            });
            *live = l;
        };
        loop {
            if synced {
                let me = if self.lost_once.load(Ordering::SeqCst) {
                    ""
                } else {
                    self.cfg.identity.as_str()
                };
                let claim = match &live {
                    None => deleted_until.is_none_or(|t| Instant::now() >= t),
                    Some(l) => claimable(l, me, seen_change, Instant::now()),
                };
                if !claim {
                    kept = None;
                } else {
                    let was_kept = kept.is_some();
                    let mut my_turn = kept.take();
                    if let (Some(turn), None) = (turn, &my_turn) {
                        let guard = tokio::select! {
                            biased;
                            _ = cancel.cancelled() => return Ok(None),
                            guard = turn.lock() => guard,
                        };
                        if *guard {
                            return Ok(None);
                        }
                        my_turn = Some(guard);
                    }
                    if cancel.is_cancelled() {
                        return Ok(None);
                    }
                    let sent = Instant::now();
                    let attempt = tokio::time::timeout(self.cfg.renew_deadline, self.write(live.clone()));
                    let refused = match attempt.await {
                        Ok(Ok(true)) => {
                            if let Some(won) = my_turn.as_mut() {
                                **won = true;
                            }
                            let deadline = sent + self.cfg.renew_deadline;
                            self.gate.open_until(deadline);
                            return Ok(Some(deadline));
                        }
                        Ok(Ok(false)) => true,
                        Ok(Err(e)) => {
                            tracing::warn!(error = %e, "taking the Lease failed; retrying");
                            false
                        }
                        Err(_) => {
                            tracing::warn!(lease = %self.cfg.name, "taking the Lease timed out; retrying");
                            false
                        }
                    };
                    // A refusal is an outcome known, unless an earlier claim's is not (a create
                    // that landed is refused the second time).
                    if !refused || was_kept {
                        kept = my_turn;
                    }
                }
            }
            // Look again when the holder's claim would run out, or on its next change.
            let wait = match live.as_ref().and_then(|l| l.spec.as_ref()) {
                // Held, or naming no holder (a release: 1 s): claimable once unchanged for
                // its duration.
                Some(s) => (seen_change + lease_duration(s))
                    .saturating_duration_since(Instant::now())
                    .clamp(Duration::from_millis(100), self.cfg.lease_duration),
                None => match deleted_until {
                    Some(t) => t
                        .saturating_duration_since(Instant::now())
                        .clamp(Duration::from_millis(100), self.cfg.lease_duration),
                    _ => self.cfg.retry_period,
                },
            };
            tokio::select! {
                _ = cancel.cancelled() => return Ok(None),
                _ = tokio::time::sleep_until((listing_since + self.cfg.lease_duration).into()), if !synced => {
                    tracing::warn!(lease = %self.cfg.name, "listing the Lease did not finish in time; starting again");
                    events = watch();
                    listing_since = Instant::now();
                }
                _ = tokio::time::sleep(wait), if synced => {
                    match tokio::time::timeout(self.cfg.retry_period, self.api.get_opt(&self.cfg.name)).await {
                        Ok(Ok(l)) => { observe(l, &mut live, &mut seen_change, &mut deleted_until); }
                        Ok(Err(e)) => tracing::warn!(error = %e, lease = %self.cfg.name, "reading the Lease failed; retrying"),
                        Err(_) => tracing::warn!(lease = %self.cfg.name, "reading the Lease timed out; retrying"),
                    }
                }
                ev = events.next() => match ev {
                    Some(Ok(watcher::Event::Apply(l) | watcher::Event::InitApply(l))) => { observe(Some(l), &mut live, &mut seen_change, &mut deleted_until); }
                    Some(Ok(watcher::Event::Delete(_))) => { observe(None, &mut live, &mut seen_change, &mut deleted_until); }
                    Some(Ok(watcher::Event::Init)) => {}
                    Some(Ok(watcher::Event::InitDone)) => synced = true,
                    Some(Err(e)) => {
                        tracing::warn!(error = %e, lease = %self.cfg.name, "watching the Lease failed; retrying");
                        tokio::time::sleep(self.cfg.retry_period).await;
                    }
                    None => {
                        events = watch();
                        listing_since = Instant::now();
                    }
                },
            }
        }
    }

    /// One renewal: write the Lease as this replica last wrote it, with a new stamp; only if
    /// that is refused, read it, give up if someone else holds it (or nobody: a deleted Lease
    /// or an emptied holder may already have been claimed by a standby that saw it), and
    /// write the live one.
    ///
    /// The first write carries the resourceVersion and uid of our last write, so the apiserver
    /// refuses it (409) once anyone else has changed the Lease, or deleted it (even if it was
    /// made again since: the uid differs). One round trip instead of two while nobody else
    /// writes is what lets a renewal meet its deadline on a loaded apiserver (client-go renews
    /// the same way).
    async fn renew_once(&self) -> Result<Renewal, LeaderError> {
        // Our own last write always names us as the holder.
        let mine = self.written.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(mine) = mine {
            match self.write(Some(mine)).await {
                Ok(true) => return Ok(Renewal::Held),
                // Changed or deleted by someone (409): read what it says now.
                Ok(false) => {}
                Err(e) => return Err(e),
            }
        }
        let live = self.api.get_opt(&self.cfg.name).await.map_err(|e| self.err(e))?;
        let holder = live
            .as_ref()
            .and_then(|l| l.spec.as_ref()?.holder_identity.clone())
            .unwrap_or_default();
        if holder != self.cfg.identity {
            return Ok(Renewal::TakenBy(holder));
        }
        if self.write(live).await? {
            Ok(Renewal::Held)
        } else {
            Err(self.err(kube::Error::Service("the Lease changed while renewing".into())))
        }
    }

    /// Renews every `retry_period` until `cancel` fires (`Ok`) or the Lease could not be
    /// renewed before the deadline or was taken by another replica (`Err`; the gate is then
    /// closed). Each attempt may only use the time left to the deadline.
    ///
    /// Renewals start a `retry_period` after the last successful one *started*, not after its
    /// answer came: the deadline counts from the start, so a slow answer does not also delay
    /// the next attempt and shorten the time it has. `deadline` is the one
    /// [`LeaderElector::acquire`] returned (a renew deadline after its write started).
    pub async fn renew(&self, cancel: &CancellationToken, mut deadline: Instant) -> Result<(), LeaderError> {
        let mut next = deadline
            .checked_sub(self.cfg.renew_deadline)
            .unwrap_or_else(Instant::now)
            + self.cfg.retry_period;
        loop {
            // A renewal already due (the last answer took a period or more) never wins over
            // a stop: renewals end at shutdown, and the gate closes a deadline later at most.
            tokio::select! {
                biased;
                _ = cancel.cancelled() => return Ok(()),
                _ = tokio::time::sleep_until(next.into()) => {}
            }
            loop {
                let sent = Instant::now();
                let left = deadline.saturating_duration_since(sent);
                if left.is_zero() {
                    self.gate.close();
                    return Err(self.lost());
                }
                match tokio::time::timeout(left, self.renew_once()).await {
                    Ok(Ok(Renewal::Held)) => {
                        deadline = sent + self.cfg.renew_deadline;
                        next = sent + self.cfg.retry_period;
                        self.gate.open_until(deadline);
                        break;
                    }
                    Ok(Ok(Renewal::TakenBy(holder))) => {
                        self.gate.close();
                        self.lost_once.store(true, Ordering::SeqCst);
                        return Err(LeaderError::TakenOver {
                            name: self.cfg.name.clone(),
                            holder,
                        });
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(error = %e, ?left, "renewing the Lease failed; retrying within the deadline");
                        let pause = (self.cfg.retry_period / 4)
                            .min(deadline.saturating_duration_since(Instant::now()));
                        tokio::select! {
                            biased;
                            _ = cancel.cancelled() => return Ok(()),
                            _ = tokio::time::sleep(pause) => {}
                        }
                    }
                    Err(_) => {
                        self.gate.close();
                        return Err(self.lost());
                    }
                }
            }
        }
    }

    /// Gives the Lease up (if we still hold it) so a standby can take over immediately.
    pub async fn release(&self) -> Result<(), LeaderError> {
        self.gate.close();
        let get = tokio::time::timeout(self.cfg.retry_period, self.api.get_opt(&self.cfg.name));
        let Ok(got) = get.await else {
            return Ok(());
        };
        let Some(mut lease) = got.map_err(|e| self.err(e))? else {
            return Ok(());
        };
        let Some(spec) = lease.spec.as_mut() else {
            return Ok(());
        };
        if spec.holder_identity.as_deref() != Some(self.cfg.identity.as_str()) {
            return Ok(());
        }
        let t = now();
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        spec.acquire_time = Some(t.clone());
        spec.renew_time = Some(t);
        let pp = PostParams::default();
        let put = self.api.replace(&self.cfg.name, &pp, &lease);
        match tokio::time::timeout(self.cfg.retry_period, put).await {
            Err(_) | Ok(Ok(_)) | Ok(Err(kube::Error::Api(_))) => Ok(()),
            Ok(Err(e)) => Err(self.err(e)),
        }
    }
}

/// Waits until this replica holds one of the Leases `candidates` (any one: they are
/// interchangeable, as sharding slots are) and returns which, with its renewal deadline; `None`
/// if `cancel` fired first. Every Lease is watched at once, each with a gate of its own, and
/// claimed in turn: once one is won, no other is written. A replica named in a second Lease
/// would release it, and the sharder would keep that slot on its ring for a spare while
/// nobody holds it. The caller renews the one won with an elector on its own gate, which it
/// opens until the deadline.
pub(crate) async fn acquire_one(
    client: &Client,
    candidates: &[LeaderElectionConfig],
    cancel: &CancellationToken,
) -> Result<Option<(usize, Instant)>, LeaderError> {
    let stop = cancel.child_token();
    let electors: Vec<LeaderElector> = candidates
        .iter()
        .map(|cfg| LeaderElector::new(client.clone(), cfg.clone(), WriteGate::new()))
        .collect();
    let turn = tokio::sync::Mutex::new(false);
    let mut attempts: futures::stream::FuturesUnordered<_> = electors
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let (stop, turn) = (stop.clone(), &turn);
            async move { (i, e.acquire_in_turn(&stop, Some(turn)).await) }
        })
        .collect();
    let mut won = None;
    let mut failed = None;
    while let Some((i, r)) = attempts.next().await {
        match r {
            Ok(Some(deadline)) if won.is_none() => {
                won = Some((i, deadline));
                stop.cancel();
            }
            // Unreachable: the winner sets the turn before another claim is written. Kept as a
            // safety net.
            Ok(Some(_)) => {
                if let Err(e) = electors[i].release().await {
                    tracing::warn!(error = %e, "releasing a second Lease failed; it runs out unrenewed");
                }
            }
            Ok(None) => {}
            Err(e) => {
                failed.get_or_insert(e);
                stop.cancel();
            }
        }
    }
    match (won, failed) {
        (Some(w), None) => Ok(Some(w)),
        (Some((i, _)), Some(e)) => {
            let _ = electors[i].release().await;
            Err(e)
        }
        (None, Some(e)) => Err(e),
        (None, None) => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(holder: Option<&str>, secs: i32) -> Lease {
        Lease {
            metadata: Default::default(),
            spec: Some(LeaseSpec {
                holder_identity: holder.map(String::from),
                renew_time: Some(MicroTime(Timestamp::from_second(100).unwrap())),
                lease_duration_seconds: Some(secs),
                ..Default::default()
            }),
        }
    }

    #[test]
    fn a_lease_is_claimable_when_ours_or_unchanged_for_its_duration() {
        let seen = Instant::now();
        let at = |s| seen + Duration::from_secs(s);
        // Released (1 s), or its holder cleared by hand (the full duration).
        assert!(!claimable(&lease(Some(""), 1), "me", seen, at(0)));
        assert!(claimable(&lease(Some(""), 1), "me", seen, at(1)));
        assert!(!claimable(&lease(None, 15), "me", seen, at(14)));
        assert!(claimable(&lease(None, 15), "me", seen, at(15)));
        assert!(claimable(&lease(Some("me"), 15), "me", seen, at(0)));
        // A replica that lost the Lease claims as "": an emptied holder is not its own.
        assert!(!claimable(&lease(Some(""), 15), "", seen, at(0)));
        assert!(!claimable(&lease(Some("other"), 15), "me", seen, at(14)));
        assert!(claimable(&lease(Some("other"), 15), "me", seen, at(15)));
        // The holder's renewTime (here far in the past by any wall clock) does not matter:
        // only how long this process has seen the record unchanged.
        assert!(!claimable(&lease(Some("other"), 15), "me", seen, at(1)));
    }

    #[test]
    fn the_gate_is_open_until_enforced_then_only_while_renewed() {
        let gate = WriteGate::new();
        assert!(gate.check().is_ok());
        gate.enforce();
        assert!(gate.check().is_err());
        gate.open_until(Instant::now() + Duration::from_secs(60));
        assert!(gate.check().is_ok());
        gate.open_until(Instant::now() - Duration::from_millis(1));
        assert!(gate.check().is_err());
        gate.open_until(Instant::now() + Duration::from_secs(60));
        gate.close();
        assert!(gate.check().is_err());
        assert_eq!(gate.refused(), 3);
    }

    /// The in-memory API server, whose answer to the first create of a Lease comes only after
    /// `delay`: the claim lands, and its writer does not learn it in time.
    #[derive(Clone)]
    struct LateFirstCreate {
        server: crate::testing::ApiServer,
        late: Arc<AtomicBool>,
        delay: Duration,
    }

    impl tower::Service<http::Request<kube::client::Body>> for LateFirstCreate {
        type Response = http::Response<crate::testing::server::Body>;
        type Error = std::convert::Infallible;
        type Future = futures::future::BoxFuture<'static, Result<Self::Response, Self::Error>>;

        fn poll_ready(&mut self, _: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
            std::task::Poll::Ready(Ok(()))
        }

        fn call(&mut self, req: http::Request<kube::client::Body>) -> Self::Future {
            let late = req.method() == http::Method::POST
                && req.uri().path().ends_with("/leases")
                && !self.late.swap(true, Ordering::SeqCst);
            let (server, delay) = (self.server.clone(), self.delay);
            Box::pin(async move {
                let answer = server.handle("replica", req).await;
                if late {
                    tokio::time::sleep(delay).await;
                }
                Ok(answer)
            })
        }
    }

    #[tokio::test]
    async fn a_slot_claim_answered_too_late_keeps_the_turn_and_no_second_slot_is_claimed() {
        let server = crate::testing::ApiServer::new();
        let late = Arc::new(AtomicBool::new(false));
        let endpoint = LateFirstCreate {
            server: server.clone(),
            late: late.clone(),
            delay: Duration::from_secs(2),
        };
        let client = Client::new(endpoint, "default");
        let slots: Vec<LeaderElectionConfig> = (0..3)
            .map(|i| {
                let mut cfg = LeaderElectionConfig::new("default", format!("slot-{i}"));
                cfg.identity = "me".into();
                (cfg.lease_duration, cfg.renew_deadline, cfg.retry_period) = (
                    Duration::from_secs(6),
                    Duration::from_millis(500),
                    Duration::from_millis(200),
                );
                cfg
            })
            .collect();
        let won = tokio::time::timeout(
            Duration::from_secs(20),
            acquire_one(&client, &slots, &CancellationToken::new()),
        )
        .await
        .expect("a slot is claimed within 20 s")
        .expect("claiming a slot does not fail")
        .expect("not cancelled");
        assert!(late.load(Ordering::SeqCst), "a claim was answered late");
        let leases: Api<Lease> = Api::namespaced(server.client_as("reader"), "default");
        let named: Vec<String> = leases
            .list(&Default::default())
            .await
            .expect("the Leases list")
            .items
            .into_iter()
            .filter(|l| l.spec.as_ref().and_then(|s| s.holder_identity.as_deref()) == Some("me"))
            .filter_map(|l| l.metadata.name)
            .collect();
        assert_eq!(
            named,
            [slots[won.0].name.clone()],
            "the replica is named in the slot it won only"
        );
    }

    #[test]
    fn the_gate_closes_when_the_wall_clock_passes_the_lease_though_the_monotonic_one_did_not() {
        let gate = WriteGate::new();
        gate.enforce();
        gate.open_until(Instant::now() + Duration::from_secs(60));
        assert!(gate.check().is_ok());
        // What a suspend of the machine looks like afterwards: the wall clock went on past
        // the lease, the monotonic clock did not.
        let slept = nanos(Duration::from_secs(61));
        let until = gate.inner.wall_until.load(Ordering::SeqCst);
        gate.inner.wall_until.store(until - slept, Ordering::SeqCst);
        assert!(gate.check().is_err());
        assert!(gate.deadline().is_err());
        // The next renewal opens it again.
        gate.open_until(Instant::now() + Duration::from_secs(60));
        assert!(gate.check().is_ok());
    }
}
