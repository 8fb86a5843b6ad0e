//! The time source of scheduled controllers, injected so schedule logic is testable without
//! waiting for the wall clock.
use std::fmt::Debug;
use std::sync::{Arc, Mutex};

use k8s_openapi::jiff::{SignedDuration, Timestamp};

/// Tells the current time. Controllers take `Arc<dyn Clock>` so tests can substitute one.
pub trait Clock: Send + Sync + Debug {
    fn now(&self) -> Timestamp;
}

/// The system's wall clock; what `opkit run` uses.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Timestamp {
        Timestamp::now()
    }
}

/// A clock that only moves when told to, for tests of time-driven logic.
#[derive(Clone, Debug)]
pub struct ManualClock(Arc<Mutex<Timestamp>>);

impl ManualClock {
    /// A clock stopped at `at`.
    pub fn new(at: Timestamp) -> Self {
        ManualClock(Arc::new(Mutex::new(at)))
    }

    /// Moves the clock forward (or back, with a negative duration).
    pub fn advance(&self, by: SignedDuration) {
        let mut t = self.0.lock().unwrap_or_else(|e| e.into_inner());
        *t = t.checked_add(by).unwrap_or(*t);
    }

    /// Sets the clock.
    pub fn set(&self, at: Timestamp) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = at;
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        *self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The default clock, shared.
pub fn system() -> Arc<dyn Clock> {
    Arc::new(SystemClock)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_only_when_told() {
        let start = Timestamp::from_second(1_700_000_000).unwrap();
        let c = ManualClock::new(start);
        assert_eq!(c.now(), start);
        c.advance(SignedDuration::from_secs(90));
        assert_eq!(c.now().as_second(), 1_700_000_090);
        c.set(start);
        assert_eq!(c.now(), start);
    }
}
