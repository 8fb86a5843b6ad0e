//! Per-object exponential backoff for failed reconciles.
//!
//! kube-runtime's `error_policy` returns one `Action` per failure; without per-object state a
//! persistently failing object retries at a fixed rate forever. This keeps a failure count per
//! object, doubles the delay each time and forgets it on the first success — or, for an object
//! deleted while failing (it never succeeds), once it has not failed for twice the longest
//! delay.
use crate::expiring::Expiring;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Failure counts keyed by object (`namespace/name`).
#[derive(Clone, Debug)]
pub struct Backoff {
    base: Duration,
    max: Duration,
    failures: Arc<Mutex<Failures>>,
}

#[derive(Debug, Default)]
struct Failures {
    /// Failures in a row and when the last one was, per object.
    by_key: Expiring<String, (u32, Instant), 64>,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff::new(Duration::from_millis(500), Duration::from_secs(300))
    }
}

impl Backoff {
    /// Delays start at `base` and double up to `max`.
    pub fn new(base: Duration, max: Duration) -> Self {
        Backoff {
            base,
            max,
            failures: Arc::default(),
        }
    }

    /// Records a failure and returns how long to wait before the next attempt.
    pub fn next_delay(&self, key: &str) -> Duration {
        self.next_delay_at(key, Instant::now())
    }

    fn next_delay_at(&self, key: &str, now: Instant) -> Duration {
        let mut f = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        // An object still failing fails again within `max`; older entries belong to objects
        // that were deleted (or stopped being retried) and would otherwise stay forever.
        let stale = self.max.saturating_mul(2);
        f.by_key
            .sweep(|_, (_, last)| now.saturating_duration_since(*last) <= stale);
        let (n, last) = f.by_key.entry(key.to_string()).or_insert((0, now));
        *n = n.saturating_add(1);
        *last = now;
        let factor = 2u32.saturating_pow((*n - 1).min(20));
        self.base.saturating_mul(factor).min(self.max)
    }

    /// Forgets an object's failures after a successful reconcile.
    pub fn reset(&self, key: &str) {
        let mut f = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        f.by_key.remove(key);
    }

    #[cfg(test)]
    fn tracked(&self) -> usize {
        self.failures
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .by_key
            .len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_double_per_object_up_to_the_cap_and_reset_on_success() {
        let b = Backoff::new(Duration::from_secs(1), Duration::from_secs(5));
        let d: Vec<_> = (0..5).map(|_| b.next_delay("ns/a").as_secs()).collect();
        assert_eq!(d, vec![1, 2, 4, 5, 5]);
        assert_eq!(
            b.next_delay("ns/b"),
            Duration::from_secs(1),
            "objects back off independently"
        );
        b.reset("ns/a");
        assert_eq!(b.next_delay("ns/a"), Duration::from_secs(1));
    }

    #[test]
    fn objects_that_stopped_failing_without_a_success_are_forgotten() {
        let b = Backoff::new(Duration::from_secs(1), Duration::from_secs(5));
        let t0 = Instant::now();
        for i in 0..63 {
            b.next_delay_at(&format!("ns/gone-{i}"), t0);
        }
        b.next_delay_at("ns/failing", t0 + Duration::from_secs(5));
        assert_eq!(b.tracked(), 64);
        // 11 s after the first failures (past twice the longest delay) only the object that
        // failed again since is kept.
        let later = t0 + Duration::from_secs(11);
        assert_eq!(b.next_delay_at("ns/new", later), Duration::from_secs(1));
        assert_eq!(b.tracked(), 2, "ns/failing and ns/new");
        assert_eq!(
            b.next_delay_at("ns/failing", later),
            Duration::from_secs(2),
            "a swept map keeps the counts it keeps"
        );
    }
}
