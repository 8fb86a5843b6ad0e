//! How one controller runs: concurrency, backoff, timeout, progress delay; set by the manager's
//! defaults, the controller and the command line, in that order.
use std::time::Duration;

/// Reconciles running at once per controller. Reconciles wait on the apiserver, not the CPU, so
/// one (controller-runtime's default) leaves most of the time idle, while no limit
/// (kube-runtime's default) lets a burst of thousands of objects hit the apiserver at once.
/// Measured with 1000 Foos (docs/benchmark.md): 4 took 2.8x the direct-client floor to create
/// the Deployments, 16 took 1.3x, unlimited 0.8x with more memory and some retried writes.
pub const DEFAULT_CONCURRENCY: u16 = 16;

/// Progress writes per rollout and controller: enough to show every slow object of a small
/// rollout; a large one shows that many, then one more per progress delay while it lasts, so
/// its cost hardly grows with its size or its length.
const DEFAULT_PROGRESS_BUDGET: u32 = 10;

/// How one controller runs. The manager's defaults, then the controller's own
/// ([`crate::Reconciler::tuning`]), then the command line (`opkit run --tune NAME.KEY=VALUE`) decide.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tuning {
    /// Reconciles running at once over all its namespaces (0: no limit); key `concurrency`.
    pub concurrency: u16,
    /// First retry delay after a failure, doubled per failure; key `backoff-base`.
    pub backoff_base: Duration,
    /// Longest retry delay; key `backoff-max`.
    pub backoff_max: Duration,
    /// A reconcile running longer is cancelled, counted (category `timeout`) and retried with
    /// backoff, so one hung request cannot hold a slot forever; key `timeout`.
    pub timeout: Duration,
    /// How long a status marked in progress ([`crate::Plan::in_progress`]) is held back
    /// before it is written anyway (a slow rollout is shown), and the least time between two
    /// such writes; key `progress-delay`.
    pub progress_delay: Duration,
    /// How many such progress writes the controller makes per rollout (from the first object
    /// in progress until none is), over all its objects, plus one per `progress_delay` while
    /// the rollout lasts (0: no limit): a slow rollout of 10000 objects shows some of them
    /// progressing rather than writing each one's progress. They are spent only once no
    /// object has settled for a delay: a rollout that keeps advancing writes no progress, so
    /// it costs the writes of a fast one; key `progress-budget`.
    pub progress_budget: u32,
    /// Requests wait in one line per namespace (or [`crate::Watch::fair_by`]'s key) and take
    /// turns, so a burst in one namespace does not hold the others up; `false`: one line in
    /// arrival order, as client-go's work queue keeps it; key `fair-queue`.
    pub fair_queue: bool,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            concurrency: DEFAULT_CONCURRENCY,
            backoff_base: Duration::from_millis(500),
            backoff_max: Duration::from_secs(300),
            timeout: Duration::from_secs(60),
            progress_delay: Duration::from_secs(30),
            progress_budget: DEFAULT_PROGRESS_BUDGET,
            fair_queue: true,
        }
    }
}

impl Tuning {
    /// Sets `key` (`concurrency`, `backoff-base`, `backoff-max`, `timeout`,
    /// `progress-delay`, `progress-budget`, `fair-queue`) from `value`
    /// (a count, a duration such as `500ms`, `30s`, `5m`, or `true`/`false`).
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), String> {
        let duration = || {
            parse_duration(value).ok_or_else(|| format!("{key}: not a duration (500ms, 30s, 5m): {value:?}"))
        };
        match key {
            "concurrency" => {
                self.concurrency = value
                    .parse()
                    .map_err(|_| format!("concurrency: not a count: {value:?}"))?
            }
            "backoff-base" => self.backoff_base = duration()?,
            "backoff-max" => self.backoff_max = duration()?,
            "timeout" => self.timeout = duration()?,
            "progress-delay" => self.progress_delay = duration()?,
            "progress-budget" => {
                self.progress_budget = value
                    .parse()
                    .map_err(|_| format!("progress-budget: not a count: {value:?}"))?
            }
            "fair-queue" => {
                self.fair_queue = value
                    .parse()
                    .map_err(|_| format!("fair-queue: not true or false: {value:?}"))?
            }
            _ => {
                return Err(format!(
                    "unknown setting {key:?}; known: concurrency, backoff-base, backoff-max, timeout, progress-delay, progress-budget, fair-queue"
                ));
            }
        }
        if self.backoff_base > self.backoff_max {
            return Err(format!(
                "backoff-base ({:?}) is longer than backoff-max ({:?})",
                self.backoff_base, self.backoff_max
            ));
        }
        if self.timeout.is_zero() {
            return Err("timeout must be longer than 0".into());
        }
        Ok(())
    }
}

fn parse_duration(s: &str) -> Option<Duration> {
    let (n, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit())?);
    let n: u64 = n.parse().ok()?;
    match unit {
        "ms" => Some(Duration::from_millis(n)),
        "s" => Some(Duration::from_secs(n)),
        "m" => Some(Duration::from_secs(n * 60)),
        "h" => Some(Duration::from_secs(n * 3600)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_parse_and_refuse_what_does_not_hold_together() {
        let mut t = Tuning::default();
        t.set("concurrency", "4").unwrap();
        t.set("timeout", "90s").unwrap();
        t.set("backoff-base", "250ms").unwrap();
        t.set("backoff-max", "2m").unwrap();
        t.set("progress-delay", "10s").unwrap();
        t.set("progress-budget", "5").unwrap();
        t.set("fair-queue", "false").unwrap();
        assert_eq!(
            t,
            Tuning {
                concurrency: 4,
                backoff_base: Duration::from_millis(250),
                backoff_max: Duration::from_secs(120),
                timeout: Duration::from_secs(90),
                progress_delay: Duration::from_secs(10),
                progress_budget: 5,
                fair_queue: false,
            }
        );
        assert!(
            t.set("fair-queue", "yes")
                .unwrap_err()
                .contains("not true or false")
        );
        assert!(t.set("timeout", "soon").unwrap_err().contains("not a duration"));
        assert!(t.set("timeout", "0s").unwrap_err().contains("longer than 0"));
        assert!(
            t.set("backoff-base", "5m")
                .unwrap_err()
                .contains("longer than backoff-max")
        );
        assert!(t.set("colour", "blue").unwrap_err().contains("unknown setting"));
    }
}
