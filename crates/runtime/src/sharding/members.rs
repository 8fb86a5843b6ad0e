//! Who is a live member, as the sharder judges it: by the member Leases it watches, timed on
//! its own monotonic clock from when it saw each one change, never by comparing a member's
//! `renewTime` with its own wall clock (the same rule as a standby's in [`crate::leader`]).
//!
//! Only its holder may end a member's claim early (a release names no holder and lasts 1 s).
//! A Lease deleted while held, or whose holder someone else cleared, still counts as held
//! for its duration from when the sharder saw that (not from the last renewal it saw, which
//! a relist after a lost watch may have skipped): its member may not know yet, and writes
//! until its next renewal fails and closes its gate, a renew deadline at most after its last
//! renewal.
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::LeaseSpec;

use crate::leader::lease_duration as duration;

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
    /// Until when it counts as held although its record names no holder (cleared by
    /// someone) or is gone (deleted).
    grace: Option<Instant>,
    /// Its Lease was deleted: it is forgotten once `grace` ends.
    deleted: bool,
}

fn names_holder(spec: &LeaseSpec) -> bool {
    spec.holder_identity.as_deref().is_some_and(|h| !h.is_empty())
}

impl Members {
    /// Records the Lease of `member` as seen at `now` (a watch event or a list).
    /// A record that stops naming a holder keeps the member held for that record's duration
    /// from `now` (1 s after a release, a full duration after a hand edit), or for `rejoin`
    /// if longer (a slot: [`super::SLOT_REJOIN`]).
    pub fn observe(&mut self, member: &str, spec: LeaseSpec, rejoin: Duration, now: Instant) {
        let held = names_holder(&spec);
        match self.seen.get_mut(member) {
            Some(s) if s.spec == spec && !s.deleted => {}
            Some(s) => {
                if held {
                    s.renewed = now;
                    s.grace = None;
                } else if names_holder(&s.spec) && !s.deleted {
                    s.grace = Some(now + duration(&spec).max(rejoin));
                }
                s.deleted = false;
                s.spec = spec;
                s.changed = now;
            }
            None => {
                // A slot first seen released (by a sharder that has just started) may have
                // been released a moment ago, its spare about to claim it: it waits as if the
                // release had been seen now.
                let grace =
                    (!names_holder(&spec) && !rejoin.is_zero()).then(|| now + duration(&spec).max(rejoin));
                self.seen.insert(
                    member.to_string(),
                    Seen {
                        spec,
                        changed: now,
                        renewed: now,
                        grace,
                        deleted: false,
                    },
                );
            }
        }
    }

    /// Whether `member`'s Lease has been seen (and not deleted since).
    pub fn knows(&self, member: &str) -> bool {
        self.seen.contains_key(member)
    }

    /// Takes in that `member`'s Lease was deleted at `now`. One that named no holder is
    /// forgotten at once; one still held (deleted by hand) counts as held for its duration
    /// from `now`, then is forgotten by [`Members::settle`].
    pub fn remove(&mut self, member: &str, now: Instant) {
        let Some(s) = self.seen.get_mut(member) else {
            return;
        };
        if names_holder(&s.spec) && !s.deleted {
            s.grace = Some(now + duration(&s.spec));
        }
        s.deleted = true;
        if s.grace.is_none() {
            self.seen.remove(member);
        }
    }

    /// Ends `member`'s grace: the sharder itself took its Lease (cleared its holder) after
    /// it had stood still for its duration, so its gate is already closed.
    pub fn taken(&mut self, member: &str) {
        if let Some(s) = self.seen.get_mut(member) {
            s.grace = None;
        }
    }

    /// Forgets `member` at once, whatever its Lease said.
    pub fn forget(&mut self, member: &str) {
        self.seen.remove(member);
    }

    /// Ends the graces that ran out by `now` (see [`Members::remove`]); whether any did.
    pub fn settle(&mut self, now: Instant) -> bool {
        let mut ended = false;
        for s in self.seen.values_mut() {
            if s.grace.is_some_and(|g| g <= now) {
                s.grace = None;
                ended = true;
            }
        }
        self.seen.retain(|_, s| !s.deleted || s.grace.is_some());
        ended
    }

    /// Whether `member` is live at `now`: its Lease has a holder and changed less than its
    /// duration ago (or it is in a grace, see [`Members::remove`]). A member is dead only
    /// once its Lease has stood unchanged for that long, by which time its write gate has
    /// closed.
    pub fn is_live(&self, member: &str, now: Instant) -> bool {
        self.seen.get(member).is_some_and(|s| match s.grace {
            Some(g) => now < g,
            None => {
                names_holder(&s.spec)
                    && !s.deleted
                    && now.saturating_duration_since(s.changed) < duration(&s.spec)
            }
        })
    }

    /// Whether `member`'s Lease names a holder (or it is in a grace): it is on the ring until
    /// the sharder has fenced it ([`Members::expired`]), it released its Lease, or its grace
    /// ended ([`Members::settle`]).
    pub fn is_held(&self, member: &str) -> bool {
        self.seen
            .get(member)
            .is_some_and(|s| s.grace.is_some() || (names_holder(&s.spec) && !s.deleted))
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
            .iter()
            .filter(|(_, s)| s.grace.is_none())
            .map(|(m, _)| m)
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
                !self.is_live(m, now) && now.saturating_duration_since(s.changed) >= duration(&s.spec) + after
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

    /// When the next live member would be judged dead if its Lease does not change, or a
    /// grace ends, so the sharder looks again then.
    pub fn next_expiry(&self, now: Instant) -> Option<Instant> {
        self.seen
            .iter()
            .filter(|(m, _)| self.is_live(m, now))
            .map(|(_, s)| s.grace.unwrap_or(s.changed + duration(&s.spec)))
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
        m.observe("a", spec("a_1", 100), Duration::ZERO, at(0));
        m.observe("b", spec("b_1", 100), Duration::ZERO, at(0));
        assert_eq!(m.live(at(5)), ["a", "b"]);
        // "a" renews; "b" does not.
        m.observe("a", spec("a_1", 108), Duration::ZERO, at(8));
        // The same record seen again is no renewal.
        m.observe("b", spec("b_1", 100), Duration::ZERO, at(8));
        assert_eq!(m.next_expiry(at(9)), Some(at(10)));
        assert_eq!(m.live(at(10)), ["a"]);
        assert!(!m.is_live("b", at(10)));
        assert_eq!(m.next_expiry(at(10)), Some(at(18)));
        // A renewTime far behind any wall clock does not matter, only seen changes.
        m.observe("c", spec("c_1", 0), Duration::ZERO, at(10));
        assert!(m.is_live("c", at(19)));
        // "b" released its Lease (1 s); deleted after that, it is forgotten at once.
        let mut released = spec("", 100);
        released.lease_duration_seconds = Some(1);
        m.observe("b", released, Duration::ZERO, at(10));
        m.settle(at(11));
        m.remove("b", at(12));
        assert!(!m.knows("b"));
        assert_eq!(m.live(at(12)), ["a", "c"]);
    }

    #[test]
    fn a_lease_deleted_or_cleared_by_hand_counts_as_held_for_its_duration_from_when_that_was_seen() {
        let t0 = Instant::now();
        let at = |s| t0 + Duration::from_secs(s);
        let mut m = Members::default();
        // Deleted while held: its member writes until its next renewal fails.
        m.observe("a", spec("a_1", 100), Duration::ZERO, at(0));
        m.observe("a", spec("a_1", 104), Duration::ZERO, at(4));
        m.remove("a", at(5));
        assert!(m.is_held("a") && m.is_live("a", at(14)) && m.knows("a"));
        assert!(m.expired(at(14)).is_empty(), "a deleted Lease cannot be taken");
        assert_eq!(m.next_expiry(at(5)), Some(at(15)));
        assert!(!m.settle(at(14)));
        assert!(m.settle(at(15)));
        assert!(!m.knows("a") && !m.is_held("a"));

        // Its holder cleared by someone else, the duration kept.
        m.observe("b", spec("b_1", 100), Duration::ZERO, at(0));
        m.observe("b", spec("", 100), Duration::ZERO, at(2));
        assert_eq!(m.held(), ["b"]);
        m.settle(at(11));
        assert!(m.is_held("b"));
        m.settle(at(12));
        assert!(!m.is_held("b") && m.knows("b"));

        // Released by its holder (duration 1 s, its gate closed first): 1 s.
        m.observe("c", spec("c_1", 100), Duration::ZERO, at(20));
        let mut released = spec("", 101);
        released.lease_duration_seconds = Some(1);
        m.observe("c", released, Duration::ZERO, at(25));
        assert!(m.is_held("c"));
        m.settle(at(26));
        assert!(!m.is_held("c"));

        // Seen gone only by a relist long after the last renewal it saw: a full duration
        // from then, for the member may have renewed unseen just before.
        m.observe("e", spec("e_1", 100), Duration::ZERO, at(0));
        m.remove("e", at(60));
        assert!(m.is_live("e", at(69)) && !m.is_live("e", at(70)));

        // A member whose Lease comes back within its grace stays, as a live member.
        m.observe("d", spec("d_1", 100), Duration::ZERO, at(30));
        m.remove("d", at(31));
        m.observe("d", spec("d_1", 132), Duration::ZERO, at(32));
        m.settle(at(41));
        assert!(m.knows("d") && m.is_live("d", at(41)) && !m.is_live("d", at(42)));
        assert_eq!(m.expired(at(42)), ["d"]);
    }

    #[test]
    fn a_released_or_unknown_lease_is_no_member() {
        let now = Instant::now();
        let mut m = Members::default();
        m.observe("a", spec("", 100), Duration::ZERO, now);
        assert!(!m.is_live("a", now));
        assert!(!m.is_live("nobody", now));
        assert_eq!(m.next_expiry(now), None);
    }

    #[test]
    fn an_expired_member_stays_held_until_its_lease_is_taken() {
        let t0 = Instant::now();
        let at = |s| t0 + Duration::from_secs(s);
        let mut m = Members::default();
        m.observe("a", spec("a_1", 100), Duration::ZERO, at(0));
        m.observe("b", spec("b_1", 100), Duration::ZERO, at(0));
        m.observe("a", spec("a_1", 111), Duration::ZERO, at(11));
        assert_eq!(m.expired(at(12)), ["b"]);
        assert_eq!(m.held(), ["a", "b"]);
        // The sharder took b's Lease (holder cleared): off the ring. Its handover starts from
        // its last renewal, not from the taking.
        m.observe("b", spec("", 100), Duration::ZERO, at(12));
        m.taken("b");
        assert!(m.expired(at(12)).is_empty());
        assert_eq!(m.held(), ["a"]);
        assert_eq!(m.last_renewed("b"), Some(at(0)));
    }

    #[test]
    fn a_member_is_forgotten_only_long_after_it_died() {
        let t0 = Instant::now();
        let at = |s| t0 + Duration::from_secs(s);
        let mut m = Members::default();
        m.observe("a", spec("a_1", 100), Duration::ZERO, at(0));
        m.observe("b", spec("b_1", 100), Duration::ZERO, at(0));
        let after = Duration::from_secs(60);
        // Expired from 10 s on, but still naming a holder: never forgotten before it is taken.
        assert!(m.gone_for(after, at(200)).iter().all(|x| x != "b"));
        m.observe("b", spec("", 100), Duration::ZERO, at(15));
        m.taken("b");
        // Taken at 15 s (its record changed then): forgettable from 85 s on.
        assert!(m.gone_for(after, at(84)).is_empty());
        m.observe("a", spec("a_1", 150), Duration::ZERO, at(50));
        assert_eq!(m.gone_for(after, at(85)), ["b"]);
        assert_eq!(m.last_renewed("a"), Some(at(50)));
        assert!(m.gone_for(after, at(119)).iter().all(|x| x != "a"));
    }

    #[test]
    fn a_released_slot_stays_on_the_ring_for_a_spare_to_claim() {
        let t0 = Instant::now();
        let at = |s| t0 + Duration::from_secs(s);
        let rejoin = Duration::from_secs(30);
        let mut released = spec("", 100);
        released.lease_duration_seconds = Some(1);
        let mut m = Members::default();
        m.observe("slot-0", spec("a_1", 100), rejoin, at(0));
        m.observe("x", spec("x_1", 100), Duration::ZERO, at(0));
        m.observe("slot-0", released.clone(), rejoin, at(2));
        m.observe("x", released.clone(), Duration::ZERO, at(2));
        m.settle(at(4));
        // A member of its own is off the ring a second after its release; a slot is not.
        assert_eq!(m.held(), ["slot-0"]);
        // A spare claims it: held again, no grace left over.
        m.observe("slot-0", spec("d_1", 120), rejoin, at(5));
        m.settle(at(40));
        assert!(m.is_held("slot-0") && !m.is_live("slot-0", at(40)));
        assert_eq!(m.expired(at(40)), ["slot-0"]);
        // Nobody claims a released slot: it leaves the ring once its rejoin time is over.
        m.observe("slot-0", released.clone(), rejoin, at(41));
        m.settle(at(70));
        assert!(m.is_held("slot-0"));
        m.settle(at(71));
        assert!(!m.is_held("slot-0"));
        // A sharder that starts and finds a slot released cannot tell since when: it waits
        // as if the release were new.
        let mut fresh = Members::default();
        fresh.observe("slot-1", released, rejoin, at(100));
        assert!(fresh.is_held("slot-1") && fresh.is_live("slot-1", at(129)));
        fresh.settle(at(130));
        assert!(!fresh.is_held("slot-1"));
    }
}
