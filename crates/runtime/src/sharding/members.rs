//! Who is a live member, as the sharder judges it: by the member Leases it watches, timed on
//! its own monotonic clock from when it saw each one change, never by comparing a member's
//! `renewTime` with its own wall clock (the same rule as a standby's in [`crate::leader`]).
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::LeaseSpec;

/// The member Leases seen so far.
#[derive(Debug, Default)]
pub struct Members {
    seen: BTreeMap<String, Seen>,
}

#[derive(Debug)]
struct Seen {
    spec: LeaseSpec,
    changed: Instant,
    /// When it was last seen renewed by a holder (not when the sharder took it or it was
    /// released): where a handover from it starts.
    renewed: Instant,
}

impl Members {
    /// Records the Lease of `member` as seen at `now` (a watch event or a list).
    pub fn observe(&mut self, member: &str, spec: LeaseSpec, now: Instant) {
        let held = spec.holder_identity.as_deref().is_some_and(|h| !h.is_empty());
        match self.seen.get_mut(member) {
            Some(s) if s.spec == spec => {}
            Some(s) => {
                if held {
                    s.renewed = now;
                }
                s.spec = spec;
                s.changed = now;
            }
            None => {
                self.seen.insert(
                    member.to_string(),
                    Seen {
                        spec,
                        changed: now,
                        renewed: now,
                    },
                );
            }
        }
    }

    /// Whether `member`'s Lease has been seen (and not deleted since).
    pub fn knows(&self, member: &str) -> bool {
        self.seen.contains_key(member)
    }

    /// Forgets `member` (its Lease was deleted: it stopped and let go of everything).
    pub fn remove(&mut self, member: &str) {
        self.seen.remove(member);
    }

    /// Whether `member` is live at `now`: its Lease has a holder and changed less than its
    /// duration ago. A member is dead only once its Lease has stood unchanged for that long,
    /// by which time its write gate has closed.
    pub fn is_live(&self, member: &str, now: Instant) -> bool {
        self.seen.get(member).is_some_and(|s| {
            let held = s.spec.holder_identity.as_deref().is_some_and(|h| !h.is_empty());
            let secs = u64::try_from(s.spec.lease_duration_seconds.unwrap_or(0)).unwrap_or(0);
            held && now.saturating_duration_since(s.changed) < Duration::from_secs(secs)
        })
    }

    /// Whether `member`'s Lease names a holder: it is on the ring until the sharder has fenced
    /// it ([`Members::expired`]) or it released its Lease.
    pub fn is_held(&self, member: &str) -> bool {
        self.seen
            .get(member)
            .is_some_and(|s| s.spec.holder_identity.as_deref().is_some_and(|h| !h.is_empty()))
    }

    /// The members whose Lease names a holder, sorted: the ring.
    pub fn held(&self) -> Vec<String> {
        self.seen.keys().filter(|m| self.is_held(m)).cloned().collect()
    }

    /// The members whose Lease still names a holder but has not changed for its duration at
    /// `now`: their gates have closed, unless this sharder missed renewals (it was busy, or
    /// the watch lagged). Only a conditional write of the Lease tells the two apart.
    pub fn expired(&self, now: Instant) -> Vec<String> {
        self.seen
            .keys()
            .filter(|m| self.is_held(m) && !self.is_live(m, now))
            .cloned()
            .collect()
    }

    /// When `member`'s Lease was last seen renewed by its holder, if it is known: a Lease
    /// the sharder took, or one released, keeps the time of the renewal before.
    pub fn last_renewed(&self, member: &str) -> Option<Instant> {
        self.seen.get(member).map(|s| s.renewed)
    }

    /// The members whose Lease names no holder (released, or taken by the sharder) and has
    /// stood unchanged for its duration plus `after` at `now`: their Leases can go. A Lease
    /// still naming a holder is never among them, however old: only taking it decides.
    pub fn gone_for(&self, after: Duration, now: Instant) -> Vec<String> {
        self.seen
            .iter()
            .filter(|(m, _)| !self.is_held(m))
            .filter(|(m, s)| {
                let secs = u64::try_from(s.spec.lease_duration_seconds.unwrap_or(0)).unwrap_or(0);
                !self.is_live(m, now)
                    && now.saturating_duration_since(s.changed) >= Duration::from_secs(secs) + after
            })
            .map(|(m, _)| m.clone())
            .collect()
    }

    /// The live members at `now`, sorted.
    pub fn live(&self, now: Instant) -> Vec<String> {
        self.seen
            .keys()
            .filter(|m| self.is_live(m, now))
            .cloned()
            .collect()
    }

    /// When the next live member would be judged dead if its Lease does not change, so the
    /// sharder looks again then.
    pub fn next_expiry(&self, now: Instant) -> Option<Instant> {
        self.seen
            .iter()
            .filter(|(m, _)| self.is_live(m, now))
            .map(|(_, s)| {
                let secs = u64::try_from(s.spec.lease_duration_seconds.unwrap_or(0)).unwrap_or(0);
                s.changed + Duration::from_secs(secs)
            })
            .min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
    use k8s_openapi::jiff::Timestamp;

    fn spec(holder: &str, renewed: i64) -> LeaseSpec {
        LeaseSpec {
            holder_identity: Some(holder.into()),
            lease_duration_seconds: Some(10),
            renew_time: Some(MicroTime(Timestamp::from_second(renewed).unwrap())),
            ..Default::default()
        }
    }

    #[test]
    fn a_member_is_live_while_its_lease_changes_within_its_duration() {
        let t0 = Instant::now();
        let at = |s| t0 + Duration::from_secs(s);
        let mut m = Members::default();
        m.observe("a", spec("a_1", 100), at(0));
        m.observe("b", spec("b_1", 100), at(0));
        assert_eq!(m.live(at(5)), ["a", "b"]);
        // "a" renews; "b" does not.
        m.observe("a", spec("a_1", 108), at(8));
        // The same record seen again is no renewal.
        m.observe("b", spec("b_1", 100), at(8));
        assert_eq!(m.next_expiry(at(9)), Some(at(10)));
        assert_eq!(m.live(at(10)), ["a"]);
        assert!(!m.is_live("b", at(10)));
        assert_eq!(m.next_expiry(at(10)), Some(at(18)));
        // A renewTime far behind any wall clock does not matter, only seen changes.
        m.observe("c", spec("c_1", 0), at(10));
        assert!(m.is_live("c", at(19)));
        m.remove("a");
        assert_eq!(m.live(at(12)), ["c"]);
    }

    #[test]
    fn a_released_or_unknown_lease_is_no_member() {
        let now = Instant::now();
        let mut m = Members::default();
        m.observe("a", spec("", 100), now);
        assert!(!m.is_live("a", now));
        assert!(!m.is_live("nobody", now));
        assert_eq!(m.next_expiry(now), None);
    }

    #[test]
    fn an_expired_member_stays_held_until_its_lease_is_taken() {
        let t0 = Instant::now();
        let at = |s| t0 + Duration::from_secs(s);
        let mut m = Members::default();
        m.observe("a", spec("a_1", 100), at(0));
        m.observe("b", spec("b_1", 100), at(0));
        m.observe("a", spec("a_1", 111), at(11));
        assert_eq!(m.expired(at(12)), ["b"]);
        assert_eq!(m.held(), ["a", "b"]);
        // The sharder took b's Lease (holder cleared): off the ring. Its handover starts from
        // its last renewal, not from the taking.
        m.observe("b", spec("", 100), at(12));
        assert!(m.expired(at(12)).is_empty());
        assert_eq!(m.held(), ["a"]);
        assert_eq!(m.last_renewed("b"), Some(at(0)));
    }

    #[test]
    fn a_member_is_forgotten_only_long_after_it_died() {
        let t0 = Instant::now();
        let at = |s| t0 + Duration::from_secs(s);
        let mut m = Members::default();
        m.observe("a", spec("a_1", 100), at(0));
        m.observe("b", spec("b_1", 100), at(0));
        let after = Duration::from_secs(60);
        // Expired from 10 s on, but still naming a holder: never forgotten before it is taken.
        assert!(m.gone_for(after, at(200)).iter().all(|x| x != "b"));
        m.observe("b", spec("", 100), at(5));
        // Taken at 5 s (its record changed then): forgettable from 75 s on.
        assert!(m.gone_for(after, at(74)).is_empty());
        m.observe("a", spec("a_1", 150), at(50));
        assert_eq!(m.gone_for(after, at(75)), ["b"]);
        assert_eq!(m.last_renewed("a"), Some(at(50)));
        assert!(m.gone_for(after, at(119)).iter().all(|x| x != "a"));
    }
}
