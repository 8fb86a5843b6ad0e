//! The `process_*` families every Prometheus client library exports (CPU, memory, file
//! descriptors, start time), read from `/proc` at each scrape: what a dashboard's "resources"
//! row and an SRE's memory alert are built on.
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

type FloatGauge = Gauge<f64, AtomicU64>;

/// The families and the CPU time already counted.
#[derive(Clone, Default)]
pub(crate) struct Process {
    cpu: Counter<f64, AtomicU64>,
    counted_cpu: Arc<Mutex<f64>>,
    resident: FloatGauge,
    virtual_: FloatGauge,
    open_fds: FloatGauge,
    max_fds: FloatGauge,
    start_time: FloatGauge,
}

impl Process {
    pub(crate) fn register(registry: &mut Registry) -> Self {
        let p = Process::default();
        registry.register(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds",
            p.cpu.clone(),
        );
        registry.register(
            "process_resident_memory_bytes",
            "Resident memory size in bytes",
            p.resident.clone(),
        );
        registry.register(
            "process_virtual_memory_bytes",
            "Virtual memory size in bytes",
            p.virtual_.clone(),
        );
        registry.register(
            "process_open_fds",
            "Number of open file descriptors",
            p.open_fds.clone(),
        );
        registry.register(
            "process_max_fds",
            "Maximum number of open file descriptors",
            p.max_fds.clone(),
        );
        registry.register(
            "process_start_time_seconds",
            "Start time of the process since the Unix epoch in seconds",
            p.start_time.clone(),
        );
        p
    }

    /// Reads `/proc/self`; a value that cannot be read keeps its last one (not on Linux: all 0).
    pub(crate) fn refresh(&self) {
        let Some(stat) = std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|s| Stat::parse(&s))
        else {
            return;
        };
        let ticks = clock_ticks();
        let cpu = (stat.utime + stat.stime) as f64 / ticks;
        let mut counted = self.counted_cpu.lock().unwrap_or_else(|p| p.into_inner());
        if cpu > *counted {
            self.cpu.inc_by(cpu - *counted);
            *counted = cpu;
        }
        drop(counted);
        if let Some(rss) = std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| resident_bytes(&s))
        {
            self.resident.set(rss);
        }
        self.virtual_.set(stat.vsize as f64);
        if let Some(boot) = boot_time() {
            self.start_time.set(boot + stat.starttime as f64 / ticks);
        }
        if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
            self.open_fds.set(fds.count() as f64);
        }
        if let Some(max) = std::fs::read_to_string("/proc/self/limits")
            .ok()
            .and_then(|l| max_open_files(&l))
        {
            self.max_fds.set(max);
        }
    }
}

/// The fields of `/proc/self/stat` used here (see proc(5)).
#[derive(Debug, PartialEq)]
struct Stat {
    utime: u64,
    stime: u64,
    starttime: u64,
    vsize: u64,
}

impl Stat {
    fn parse(s: &str) -> Option<Stat> {
        // The command name (field 2) is in parentheses and may hold spaces: fields count from
        // after its closing one, which is field 3 (state).
        let rest = &s[s.rfind(')')? + 1..];
        let f: Vec<&str> = rest.split_whitespace().collect();
        let n = |field: usize| f.get(field - 3)?.parse::<u64>().ok();
        Some(Stat {
            utime: n(14)?,
            stime: n(15)?,
            starttime: n(22)?,
            vsize: n(23)?,
        })
    }
}

/// `Max open files` soft limit from `/proc/self/limits`.
fn max_open_files(limits: &str) -> Option<f64> {
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line["Max open files".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Seconds since the epoch at boot (`btime` of `/proc/stat`).
fn boot_time() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/stat").ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("btime ")?.trim().parse().ok())
}

/// Clock ticks per second of `/proc`'s CPU times (`USER_HZ`): 100, fixed by Linux's ABI.
fn clock_ticks() -> f64 {
    100.0
}

/// `VmRSS` of `/proc/self/status`, in bytes (independent of the page size).
fn resident_bytes(status: &str) -> Option<f64> {
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kib * 1024.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_is_read_past_a_command_name_with_spaces_and_parentheses() {
        let line = "4242 (a (b) c) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 9 0 1234 567890 321 18446744073709551615";
        assert_eq!(
            Stat::parse(line),
            Some(Stat {
                utime: 250,
                stime: 50,
                starttime: 1234,
                vsize: 567890,
            })
        );
        assert_eq!(Stat::parse("garbage"), None);
    }

    #[test]
    fn this_process_is_measured() {
        let mut r = Registry::default();
        let p = Process::register(&mut r);
        p.refresh();
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &r).unwrap();
        let value = |name: &str| -> f64 {
            out.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
                .unwrap_or_else(|| panic!("{name} missing in {out}"))
        };
        assert!(value("process_resident_memory_bytes") > 1e6, "{out}");
        assert!(value("process_open_fds") >= 3.0, "{out}");
        assert!(value("process_max_fds") >= value("process_open_fds"), "{out}");
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        let started = value("process_start_time_seconds");
        assert!(
            started <= now + 1.0 && started > now - 86400.0,
            "{started} vs {now}"
        );
    }

    #[test]
    fn resident_memory_is_read_in_kib() {
        assert_eq!(
            resident_bytes("Name:\tx\nVmRSS:\t   2048 kB\n"),
            Some(2048.0 * 1024.0)
        );
        assert_eq!(resident_bytes("Name:\tx\n"), None);
    }

    #[test]
    fn the_open_files_limit_is_the_soft_one() {
        let limits = "Limit                     Soft Limit           Hard Limit           Units\nMax open files            1024                 524288               files\n";
        assert_eq!(max_open_files(limits), Some(1024.0));
    }
}
