//! Holding back statuses that describe work still under way ([`crate::Plan::in_progress`]):
//! per object, when it was first seen in progress (or last written while in progress), so
//! that a change which settles quickly costs one status write, and a slow one is written
//! once per delay. The controller's progress writes share a budget per rollout (from the
//! first object held until none is) and one more write per delay while the rollout lasts: a
//! slow rollout of thousands of objects costs about as many writes as a slow rollout of a
//! few, the others showing their progress in `observedGeneration` until they settle.
//!
//! The budget is spent only while the rollout is stalled: when none of the objects held has
//! settled for a whole delay. A rollout that keeps advancing (objects settling one after the
//! other, as the Deployment controller or a database gets to them) writes no progress at all,
//! so ten thousand objects that take minutes cost the writes of ten thousand that take
//! seconds. An object stuck while others keep settling is shown once they stop.
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// When each object in progress started to be held; objects that settled are not in it.
pub(crate) struct Hold {
    delay: Duration,
    /// Progress writes per rollout, over all objects (0: no limit).
    budget: u32,
    inner: Mutex<Inner>,
}

/// One object held.
struct Held {
    /// Since when it is held (or when its progress was last written).
    since: Instant,
    /// When it was last looked at: entries not looked at for four delays are swept.
    seen: Instant,
}

struct Inner {
    held: HashMap<String, Held>,
    swept: Instant,
    /// Progress writes that may still be made: `budget` when a rollout starts, one more per
    /// delay while it lasts, never more than `budget`.
    tokens: f64,
    refilled: Instant,
    /// When an object held last settled: the rollout is advancing until a delay after it.
    last_settled: Option<Instant>,
}

impl Hold {
    pub(crate) fn new(delay: Duration, budget: u32) -> Self {
        Hold {
            delay,
            budget,
            inner: Mutex::new(Inner {
                held: HashMap::new(),
                swept: Instant::now(),
                tokens: f64::from(budget),
                refilled: Instant::now(),
                last_settled: None,
            }),
        }
    }

    /// For an in-progress status of `key` at `now`: `Some(wait)` to hold it back and look
    /// again after `wait`, `None` to write it (the hold starts over from `now`).
    pub(crate) fn in_progress(&self, key: &str, now: Instant) -> Option<Duration> {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        // An entry not looked at for four delays is an object deleted while in progress, or
        // one whose shown progress has not changed since (the driver asks no more about
        // those). With no entry left, the rollout is over. At most one sweep per four delays
        // keeps this O(1) per call on average.
        if now.duration_since(inner.swept) > self.delay * 4 {
            let keep = self.delay * 4;
            inner
                .held
                .retain(|_, h| now.saturating_duration_since(h.seen) <= keep);
            inner.swept = now;
            if inner.held.is_empty() {
                inner.tokens = f64::from(self.budget);
            }
        }
        let entry = inner.held.entry(key.to_string()).or_insert(Held {
            since: now,
            seen: now,
        });
        entry.seen = now;
        let held = now.duration_since(entry.since);
        if held < self.delay {
            return Some(self.delay - held);
        }
        if self.budget > 0 {
            let budget = f64::from(self.budget);
            let per_second = 1.0 / self.delay.as_secs_f64().max(0.001);
            let elapsed = now.saturating_duration_since(inner.refilled).as_secs_f64();
            inner.tokens = (inner.tokens + elapsed * per_second).min(budget);
            inner.refilled = now;
            // Still advancing: look again when it would have stalled for a delay.
            if let Some(settled) = inner.last_settled {
                let quiet = now.saturating_duration_since(settled);
                if quiet < self.delay {
                    return Some(self.delay - quiet);
                }
            }
            if inner.tokens < 1.0 {
                // Spent: shown later, or settled by then (written at once, unbudgeted).
                return Some(self.delay);
            }
            inner.tokens -= 1.0;
        }
        if let Some(entry) = inner.held.get_mut(key) {
            entry.since = now;
        }
        None
    }

    /// `key` settled (or went away) at `now`: its next in-progress status is held from
    /// scratch, and the rollout counts as advancing for a delay. When it was the last object
    /// held, the rollout is over and the next one has the whole budget.
    pub(crate) fn settled(&self, key: &str, now: Instant) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if inner.held.remove(key).is_some() {
            inner.last_settled = Some(now);
            if inner.held.is_empty() {
                inner.tokens = f64::from(self.budget);
            }
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.inner.lock().unwrap().held.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: Duration = Duration::from_secs(30);

    #[test]
    fn an_in_progress_status_is_held_for_the_delay_then_written_once_per_delay() {
        let h = Hold::new(D, 0);
        let t0 = Instant::now();
        assert_eq!(h.in_progress("a", t0), Some(D));
        assert_eq!(
            h.in_progress("a", t0 + Duration::from_secs(10)),
            Some(Duration::from_secs(20))
        );
        assert_eq!(h.in_progress("a", t0 + D), None);
        // The hold starts over after a write.
        assert_eq!(
            h.in_progress("a", t0 + D + Duration::from_secs(1)),
            Some(Duration::from_secs(29))
        );
        assert_eq!(h.in_progress("a", t0 + D * 2), None);
    }

    #[test]
    fn settling_forgets_the_object_and_others_are_held_on_their_own() {
        let h = Hold::new(D, 0);
        let t0 = Instant::now();
        assert!(h.in_progress("a", t0).is_some());
        assert!(h.in_progress("b", t0 + Duration::from_secs(20)).is_some());
        h.settled("a", t0);
        assert_eq!(h.len(), 1);
        assert_eq!(h.in_progress("a", t0 + D), Some(D));
        assert_eq!(h.in_progress("b", t0 + D), Some(Duration::from_secs(20)));
    }

    #[test]
    fn entries_of_objects_gone_while_in_progress_are_swept() {
        let h = Hold::new(D, 0);
        let t0 = Instant::now();
        for i in 0..100 {
            h.in_progress(&format!("gone-{i}"), t0);
        }
        let later = t0 + D * 5;
        assert!(h.in_progress("live", later).is_some());
        assert_eq!(h.len(), 1);
    }

    #[test]
    fn progress_writes_share_the_budget_and_wait_another_delay_when_it_is_spent() {
        let h = Hold::new(D, 2);
        let t0 = Instant::now();
        for k in ["a", "b", "c", "d"] {
            assert!(h.in_progress(k, t0).is_some());
        }
        // Two of four may write after the delay; the others wait another delay.
        assert_eq!(h.in_progress("a", t0 + D), None);
        assert_eq!(h.in_progress("b", t0 + D), None);
        assert_eq!(h.in_progress("c", t0 + D), Some(D));
        // While the rollout lasts, one more write per delay, however many objects wait.
        assert_eq!(h.in_progress("c", t0 + D + D / 2), Some(D));
        assert_eq!(h.in_progress("c", t0 + D * 2), None);
        assert_eq!(h.in_progress("d", t0 + D * 2), Some(D));
        // Settled statuses are not progress writes: settling costs nothing from the budget.
        h.settled("a", t0 + D * 2);
        assert_eq!(h.len(), 3);
    }

    #[test]
    fn a_rollout_that_is_over_leaves_the_whole_budget_to_the_next() {
        let h = Hold::new(D, 2);
        let t0 = Instant::now();
        for k in ["a", "b", "c"] {
            assert!(h.in_progress(k, t0).is_some());
        }
        assert_eq!(h.in_progress("a", t0 + D), None);
        assert_eq!(h.in_progress("b", t0 + D), None);
        assert_eq!(h.in_progress("c", t0 + D), Some(D));
        // Two settle while "c" still rolls out: the rollout goes on, with its budget spent.
        h.settled("a", t0 + D);
        h.settled("b", t0 + D);
        assert!(h.in_progress("d", t0 + D).is_some());
        assert_eq!(h.in_progress("c", t0 + D * 2), None);
        assert_eq!(h.in_progress("d", t0 + D * 2), Some(D));
        // The last two settle: the next rollout has the whole budget at once.
        h.settled("c", t0 + D * 3);
        h.settled("d", t0 + D * 3);
        let t3 = t0 + D * 3;
        for k in ["e", "f", "g"] {
            assert!(h.in_progress(k, t3).is_some());
        }
        // (They are due a delay later, when the last settle is a delay old too.)
        assert_eq!(h.in_progress("e", t3 + D), None);
        assert_eq!(h.in_progress("f", t3 + D), None);
        assert_eq!(h.in_progress("g", t3 + D), Some(D));
    }

    /// `objects` in progress from `t0`; `o0`, `o1`, ... settle every 10 s, `settles` of them,
    /// and the others are looked at a second after each settle, held every time.
    fn settle_one_every_10s(h: &Hold, t0: Instant, objects: u64, settles: u64) {
        let s = Duration::from_secs;
        for i in 0..objects {
            assert!(h.in_progress(&format!("o{i}"), t0).is_some());
        }
        for i in 0..settles {
            let t = t0 + s(10 * (i + 1));
            h.settled(&format!("o{i}"), t);
            for j in (i + 1)..objects {
                let wait = h.in_progress(&format!("o{j}"), t + s(1));
                assert!(wait.is_some(), "o{j} written at {:?}", t + s(1) - t0);
            }
        }
    }

    #[test]
    fn a_rollout_advancing_for_longer_than_the_sweep_still_writes_no_progress() {
        let h = Hold::new(D, 2);
        let t0 = Instant::now();
        let s = Duration::from_secs;
        // One settles every 10 s for 250 s, past two sweeps; the others are looked at as
        // often. Entries looked at are kept, so every settle counts and nothing is written.
        settle_one_every_10s(&h, t0, 30, 25);
        assert_eq!(h.len(), 5);
        // A delay after the last settle the rollout has stalled: the budget's two write.
        let stalled = t0 + s(250) + D;
        let written = (25..30)
            .filter(|j| h.in_progress(&format!("o{j}"), stalled).is_none())
            .count();
        assert_eq!(written, 2);
    }

    #[test]
    fn a_rollout_that_keeps_advancing_writes_no_progress_until_it_stalls() {
        let h = Hold::new(D, 2);
        let t0 = Instant::now();
        let s = Duration::from_secs;
        // One object settles every 10 s: every other one is due but held, until a delay after
        // the last settle.
        settle_one_every_10s(&h, t0, 10, 6);
        assert_eq!(h.in_progress("o9", t0 + s(61)), Some(D - s(1)));
        // o5 settled at 60 s; from 90 s on the rollout has stalled: the budget is spent.
        let stalled = t0 + s(90);
        assert_eq!(h.in_progress("o6", stalled - s(1)), Some(s(1)));
        assert_eq!(h.in_progress("o6", stalled), None);
        assert_eq!(h.in_progress("o7", stalled), None);
        assert_eq!(h.in_progress("o8", stalled), Some(D));
        // Without a budget (0: every object once per delay) nothing waits for a stall.
        let h = Hold::new(D, 0);
        assert!(h.in_progress("a", t0).is_some());
        assert!(h.in_progress("b", t0).is_some());
        h.settled("a", t0 + D);
        assert_eq!(h.in_progress("b", t0 + D), None);
    }
}
