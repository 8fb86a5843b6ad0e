//! Leader election on a `coordination.k8s.io` Lease, so that of several replicas only one
//! reconciles. Same protocol and defaults as client-go's leaderelection (15 s lease, 10 s renew
//! deadline, 2 s retry), with two differences: a standby waits on a watch of the Lease instead
//! of polling, and a leader that stops releases the Lease, so a standby takes over at once.
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{ObjectMeta, PostParams};
use kube::runtime::watcher;
use kube::{Api, Client};
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
    /// A leader that could not renew for this long gives up (and the process exits).
    pub renew_deadline: Duration,
    /// How often the leader renews.
    pub retry_period: Duration,
}

impl LeaderElectionConfig {
    /// client-go's defaults, with identity `<hostname>_<pid>`.
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        let host = std::env::var("POD_NAME")
            .or_else(|_| std::env::var("HOSTNAME"))
            .or_else(|_| std::fs::read_to_string("/etc/hostname").map(|s| s.trim().to_string()))
            .unwrap_or_else(|_| "opkit".into());
        LeaderElectionConfig {
            namespace: namespace.into(),
            name: name.into(),
            identity: format!("{host}_{}", std::process::id()),
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        }
    }
}

/// Errors of leader election.
#[derive(Debug, thiserror::Error)]
#[allow(missing_docs)] // every variant says what failed in its message
pub enum LeaderError {
    #[error("reading or writing Lease {name}: {source}")]
    Api { name: String, source: kube::Error },
    #[error("leadership lost: Lease {name} not renewed within {deadline:?}")]
    Lost { name: String, deadline: Duration },
}

/// Acquires, renews and releases one Lease.
#[derive(Clone)]
pub struct LeaderElector {
    api: Api<Lease>,
    cfg: LeaderElectionConfig,
}

fn now() -> MicroTime {
    MicroTime(Timestamp::now())
}

/// Whether `lease` may be taken by `identity` at `now`: free, expired, or already ours.
pub fn claimable(lease: &Lease, identity: &str, now: Timestamp) -> bool {
    let Some(spec) = &lease.spec else { return true };
    match spec.holder_identity.as_deref() {
        None | Some("") => true,
        Some(h) if h == identity => true,
        Some(_) => expiry(spec).is_none_or(|e| e <= now),
    }
}

/// When the current holder's claim runs out.
fn expiry(spec: &LeaseSpec) -> Option<Timestamp> {
    let renewed = spec.renew_time.as_ref().or(spec.acquire_time.as_ref())?.0;
    let secs = i64::from(spec.lease_duration_seconds.unwrap_or(0));
    renewed.checked_add(SignedDuration::from_secs(secs)).ok()
}

impl LeaderElector {
    /// An elector for `cfg`'s Lease.
    pub fn new(client: Client, cfg: LeaderElectionConfig) -> Self {
        LeaderElector {
            api: Api::namespaced(client, &cfg.namespace),
            cfg,
        }
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

    /// One attempt to take or renew the Lease, given its last known state. Returns whether we
    /// hold it; a write conflict (someone else was faster) is `false`, not an error.
    async fn try_hold(&self, live: Option<Lease>) -> Result<bool, LeaderError> {
        let t = now();
        let duration = i32::try_from(self.cfg.lease_duration.as_secs()).unwrap_or(i32::MAX);
        let result = match live {
            None => {
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(self.cfg.name.clone()),
                        namespace: Some(self.cfg.namespace.clone()),
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
                if !claimable(&lease, &self.cfg.identity, t.0) {
                    return Ok(false);
                }
                let spec = lease.spec.get_or_insert_with(Default::default);
                if spec.holder_identity.as_deref() != Some(self.cfg.identity.as_str()) {
                    spec.holder_identity = Some(self.cfg.identity.clone());
                    spec.acquire_time = Some(t.clone());
                    spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
                }
                spec.lease_duration_seconds = Some(duration);
                spec.renew_time = Some(t);
                // `replace` carries the resourceVersion we read: a concurrent writer makes it
                // fail with 409 instead of two replicas both believing they lead.
                self.api
                    .replace(&self.cfg.name, &PostParams::default(), &lease)
                    .await
            }
        };
        match result {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
            Err(e) => Err(self.err(e)),
        }
    }

    /// Waits until this replica holds the Lease; `Ok(false)` if `cancel` fired first.
    pub async fn acquire(&self, cancel: &CancellationToken) -> Result<bool, LeaderError> {
        let cfg = watcher::Config::default().fields(&format!("metadata.name={}", self.cfg.name));
        let mut events = watcher(self.api.clone(), cfg).boxed();
        let mut live: Option<Lease> = None;
        let mut synced = false;
        loop {
            // Lost a race or the Lease is held: look again at its expiry or its next change.
            if synced && self.try_hold(live.clone()).await? {
                return Ok(true);
            }
            let wait = match live.as_ref().and_then(|l| l.spec.as_ref()).and_then(expiry) {
                Some(e) => Duration::try_from(Timestamp::now().duration_until(e))
                    .unwrap_or_default()
                    .clamp(Duration::from_millis(100), self.cfg.lease_duration),
                None => self.cfg.retry_period,
            };
            tokio::select! {
                _ = cancel.cancelled() => return Ok(false),
                _ = tokio::time::sleep(wait), if synced => {
                    live = self.api.get_opt(&self.cfg.name).await.map_err(|e| self.err(e))?;
                }
                ev = events.next() => match ev {
                    Some(Ok(watcher::Event::Apply(l) | watcher::Event::InitApply(l))) => live = Some(l),
                    Some(Ok(watcher::Event::Delete(_))) => live = None,
                    Some(Ok(watcher::Event::Init)) => live = None,
                    Some(Ok(watcher::Event::InitDone)) => synced = true,
                    Some(Err(e)) => {
                        tracing::warn!(error = %e, lease = %self.cfg.name, "watching the Lease failed; retrying");
                        tokio::time::sleep(self.cfg.retry_period).await;
                    }
                    None => return Err(self.err(kube::Error::Service("Lease watch ended".into()))),
                },
            }
        }
    }

    /// Renews every `retry_period` until `cancel` fires (`Ok`) or renewal fails for longer
    /// than `renew_deadline` (`Err(Lost)`).
    pub async fn renew(&self, cancel: &CancellationToken) -> Result<(), LeaderError> {
        let mut last_ok = tokio::time::Instant::now();
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return Ok(()),
                _ = tokio::time::sleep(self.cfg.retry_period) => {}
            }
            let held = match self.api.get_opt(&self.cfg.name).await {
                Ok(live) => {
                    let ours = live
                        .as_ref()
                        .and_then(|l| l.spec.as_ref()?.holder_identity.as_deref())
                        == Some(self.cfg.identity.as_str());
                    // Someone else holds it: we lost it, whatever the deadline says.
                    if !ours {
                        return Err(LeaderError::Lost {
                            name: self.cfg.name.clone(),
                            deadline: Duration::ZERO,
                        });
                    }
                    self.try_hold(live).await.unwrap_or_else(|e| {
                        tracing::warn!(error = %e, "renewing the Lease failed");
                        false
                    })
                }
                Err(e) => {
                    tracing::warn!(error = %e, "reading the Lease failed");
                    false
                }
            };
            if held {
                last_ok = tokio::time::Instant::now();
            } else if last_ok.elapsed() > self.cfg.renew_deadline {
                return Err(LeaderError::Lost {
                    name: self.cfg.name.clone(),
                    deadline: self.cfg.renew_deadline,
                });
            }
        }
    }

    /// Gives the Lease up (if we still hold it) so a standby can take over immediately.
    pub async fn release(&self) -> Result<(), LeaderError> {
        let Some(mut lease) = self.api.get_opt(&self.cfg.name).await.map_err(|e| self.err(e))? else {
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
        match self
            .api
            .replace(&self.cfg.name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) | Err(kube::Error::Api(_)) => Ok(()),
            Err(e) => Err(self.err(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(holder: Option<&str>, renewed: i64, secs: i32) -> Lease {
        Lease {
            metadata: Default::default(),
            spec: Some(LeaseSpec {
                holder_identity: holder.map(String::from),
                renew_time: Some(MicroTime(Timestamp::from_second(renewed).unwrap())),
                lease_duration_seconds: Some(secs),
                ..Default::default()
            }),
        }
    }

    #[test]
    fn a_lease_is_claimable_when_free_expired_or_ours() {
        let at = |s| Timestamp::from_second(s).unwrap();
        assert!(claimable(&lease(None, 100, 15), "me", at(101)));
        assert!(claimable(&lease(Some(""), 100, 15), "me", at(101)));
        assert!(claimable(&lease(Some("me"), 100, 15), "me", at(101)));
        assert!(!claimable(&lease(Some("other"), 100, 15), "me", at(114)));
        assert!(claimable(&lease(Some("other"), 100, 15), "me", at(115)));
    }
}
