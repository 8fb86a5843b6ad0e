//! Per-object exponential backoff for failed reconciles.
//!
//! kube-runtime's `error_policy` returns one `Action` per failure; without per-object state a
//! persistently failing object retries at a fixed rate forever. This keeps a failure count per
//! object, doubles the delay each time and forgets it on the first success.
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Failure counts keyed by object (`namespace/name`).
#[derive(Clone, Debug)]
pub struct Backoff {
    base: Duration,
    max: Duration,
    failures: Arc<Mutex<HashMap<String, u32>>>,
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
        let mut f = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        let n = f.entry(key.to_string()).or_insert(0);
        *n = n.saturating_add(1);
        let factor = 2u32.saturating_pow((*n - 1).min(20));
        self.base.saturating_mul(factor).min(self.max)
    }

    /// Forgets an object's failures after a successful reconcile.
    pub fn reset(&self, key: &str) {
        let mut f = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        f.remove(key);
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
}
