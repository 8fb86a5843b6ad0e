//! Cron schedules in a time zone: parsing, "when is the next slot", and what is due after a
//! gap (missed slots, a starting deadline), DST included; fuzzed (`make fuzz`). For
//! controllers that act on a schedule (a CronJob-like kind, a restart every night).
//!
//! Accepted: the standard five fields (`minute hour day-of-month month day-of-week`), six
//! fields with seconds first, and the macros `@yearly`/`@annually`, `@monthly`, `@weekly`,
//! `@daily`/`@midnight`, `@hourly`. Fields take `*`, `?`, numbers, `a-b`, lists and `/step`;
//! months and weekdays also take names (`JAN`, `MON`); weekday 7 is Sunday. When both
//! day-of-month and day-of-week are restricted, a day matching either one matches (as in cron).
//!
//! Daylight saving: a slot whose wall-clock time is skipped (spring forward) fires at the same
//! distance past the gap (02:30 → 03:30); a wall-clock time that happens twice (fall back)
//! fires once, at its first occurrence.
use std::fmt;
use std::str::FromStr;

use k8s_openapi::jiff::civil::{Date, DateTime, Time};
use k8s_openapi::jiff::tz::TimeZone;
use k8s_openapi::jiff::{SignedDuration, Timestamp, ToSpan};

/// How far ahead `next_after` looks before concluding a schedule never fires (e.g. Feb 30).
const HORIZON_YEARS: i16 = 8;

/// A parsed cron schedule.
#[derive(Clone, PartialEq, Eq)]
pub struct Schedule {
    source: String,
    seconds: u64,
    minutes: u64,
    hours: u32,
    days: u32,
    months: u16,
    weekdays: u8,
    days_restricted: bool,
    weekdays_restricted: bool,
}

impl fmt::Debug for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Schedule({:?})", self.source)
    }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.source)
    }
}

const MONTHS: [&str; 12] = [
    "JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC",
];
const WEEKDAYS: [&str; 7] = ["SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT"];

/// Parses one field into a bit set over `min..=max`; returns the set and whether it was `*`.
fn field(s: &str, what: &str, min: u32, max: u32, names: &[&str]) -> Result<(u64, bool), String> {
    let value = |v: &str| -> Result<u32, String> {
        if let Some(i) = names.iter().position(|n| n.eq_ignore_ascii_case(v)) {
            return Ok(i as u32 + min);
        }
        let n: u32 = v.parse().map_err(|_| {
            format!(
                "{what}: {v:?} is not a number{}",
                if names.is_empty() { "" } else { " or a name" }
            )
        })?;
        if n < min || n > max {
            return Err(format!("{what}: {n} is outside {min}-{max}"));
        }
        Ok(n)
    };
    let mut bits = 0u64;
    let mut star = false;
    for item in s.split(',') {
        let (range, step) = match item.split_once('/') {
            Some((r, st)) => {
                let step: u32 = st
                    .parse()
                    .map_err(|_| format!("{what}: step {st:?} is not a number"))?;
                if step == 0 {
                    return Err(format!("{what}: step must be at least 1"));
                }
                (r, Some(step))
            }
            None => (item, None),
        };
        let (lo, hi) = if range == "*" || range == "?" {
            if step.is_none() && s == range {
                star = true;
            }
            (min, max)
        } else if let Some((a, b)) = range.split_once('-') {
            let (a, b) = (value(a)?, value(b)?);
            if a > b {
                return Err(format!("{what}: range {range:?} runs backwards"));
            }
            (a, b)
        } else {
            let a = value(range)?;
            (a, if step.is_some() { max } else { a })
        };
        let mut v = lo;
        while v <= hi {
            bits |= 1 << v;
            // A step beyond the field's range (`5/4294967295`) just ends the walk.
            match v.checked_add(step.unwrap_or(1)) {
                Some(next) => v = next,
                None => break,
            }
        }
    }
    // Day-of-week 7 is Sunday, as in most crons.
    if what == "day-of-week" && bits & (1 << 7) != 0 {
        bits = (bits | 1) & !(1 << 7);
    }
    Ok((bits, star))
}

impl FromStr for Schedule {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let source = s.trim().to_string();
        let expanded = match source.to_ascii_lowercase().as_str() {
            "@yearly" | "@annually" => "0 0 1 1 *".to_string(),
            "@monthly" => "0 0 1 * *".to_string(),
            "@weekly" => "0 0 * * 0".to_string(),
            "@daily" | "@midnight" => "0 0 * * *".to_string(),
            "@hourly" => "0 * * * *".to_string(),
            m if m.starts_with('@') => return Err(format!("unknown macro {source:?}")),
            _ => source.clone(),
        };
        let fields: Vec<&str> = expanded.split_whitespace().collect();
        let (sec, rest) = match fields.len() {
            5 => ("0", &fields[..]),
            6 => (fields[0], &fields[1..]),
            n => {
                return Err(format!(
                    "{source:?} has {n} fields; expected 5 (minute hour day-of-month month day-of-week), 6 (with seconds first) or a macro such as @daily"
                ));
            }
        };
        let (seconds, _) = field(sec, "second", 0, 59, &[])?;
        let (minutes, _) = field(rest[0], "minute", 0, 59, &[])?;
        let (hours, _) = field(rest[1], "hour", 0, 23, &[])?;
        let (days, days_star) = field(rest[2], "day-of-month", 1, 31, &[])?;
        let (months, _) = field(rest[3], "month", 1, 12, &MONTHS)?;
        let (weekdays, weekdays_star) = field(rest[4], "day-of-week", 0, 7, &WEEKDAYS)?;
        Ok(Schedule {
            source,
            seconds,
            minutes,
            hours: hours as u32,
            days: days as u32,
            months: months as u16,
            weekdays: weekdays as u8,
            days_restricted: !days_star,
            weekdays_restricted: !weekdays_star,
        })
    }
}

impl Schedule {
    fn day_matches(&self, d: Date) -> bool {
        let dom = self.days & (1 << d.day()) != 0;
        let dow = self.weekdays & (1 << d.weekday().to_sunday_zero_offset()) != 0;
        match (self.days_restricted, self.weekdays_restricted) {
            (true, true) => dom || dow,
            (true, false) => dom,
            (false, true) => dow,
            (false, false) => true,
        }
    }

    /// The first slot strictly after `t`, in `tz`; `None` if the schedule never fires.
    pub fn next_after(&self, t: Timestamp, tz: &TimeZone) -> Option<Timestamp> {
        let start = tz.to_datetime(t);
        let limit = start.year().saturating_add(HORIZON_YEARS);
        // Whole seconds only: the next candidate is the second after `t`'s wall-clock second.
        let mut c = start
            .with()
            .subsec_nanosecond(0)
            .build()
            .ok()?
            .checked_add(1.second())
            .ok()?;
        while c.year() <= limit {
            if self.months & (1 << c.month()) == 0 {
                let first = c.date().first_of_month().checked_add(1.month()).ok()?;
                c = first.to_datetime(Time::midnight());
                continue;
            }
            if !self.day_matches(c.date()) {
                c = c.date().tomorrow().ok()?.to_datetime(Time::midnight());
                continue;
            }
            if self.hours & (1 << c.hour()) == 0 {
                c = next_unit(c, 1.hour(), |d| d.with().minute(0).second(0).build())?;
                continue;
            }
            if self.minutes & (1 << c.minute()) == 0 {
                c = next_unit(c, 1.minute(), |d| d.with().second(0).build())?;
                continue;
            }
            if self.seconds & (1 << c.second()) == 0 {
                c = c.checked_add(1.second()).ok()?;
                continue;
            }
            // `compatible`: a skipped wall-clock time moves forward by the gap, a repeated one
            // takes its first occurrence.
            let at = tz.to_ambiguous_zoned(c).compatible().ok()?.timestamp();
            if at > t {
                return Some(at);
            }
            c = c.checked_add(1.second()).ok()?;
        }
        None
    }

    /// The latest slot in `(after, until]`, if any. Looks at most `cap` slots ahead of `after`
    /// and then from later starting points, so a frequent schedule after a long gap stays cheap.
    pub fn latest_in(&self, after: Timestamp, until: Timestamp, tz: &TimeZone) -> Option<Timestamp> {
        const CAP: usize = 10_000;
        let span = until.as_second() - after.as_second();
        // Fall-back starting points, each closer to `until`.
        let starts = [span, 7 * 86_400, 86_400, 3_600, 60]
            .into_iter()
            .filter(|s| *s <= span)
            .filter_map(|s| until.checked_sub(s.seconds()).ok());
        // The furthest slot an unfinished walk reached: the answer is at least that.
        let mut reached: Option<Timestamp> = None;
        for from in starts {
            if reached.is_some_and(|r| from <= r) {
                continue;
            }
            let mut latest = None;
            let mut cur = from;
            let mut complete = false;
            for _ in 0..CAP {
                match self.next_after(cur, tz) {
                    Some(n) if n <= until => {
                        latest = Some(n);
                        cur = n;
                    }
                    _ => {
                        complete = true;
                        break;
                    }
                }
            }
            if complete {
                return match (latest, reached) {
                    (Some(l), _) => Some(l),
                    // Nothing in (from, until]: the latest lies in (reached, from] — a sparse
                    // schedule looked at outside its window, such as `* * 0-11 * * *` at 13:30.
                    (None, Some(r)) => self.latest_in(r, from, tz).or(Some(r)),
                    (None, None) => None,
                };
            }
            reached = latest.or(reached);
        }
        reached
    }
}

/// What is due at a moment for an action on a schedule ([`Schedule::due`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Due {
    /// The slot to act for now: the latest one since the last run. The earlier missed ones are
    /// not made up (as Kubernetes' CronJob does). Record it as the last run once acted on.
    pub run: Option<Timestamp>,
    /// The latest slot since the last run, skipped because it is later than the starting
    /// deadline past its time: worth a condition or an Event.
    pub too_late: Option<Timestamp>,
    /// The next slot after now: when to look again (`None`: the schedule never fires again).
    pub next: Option<Timestamp>,
}

impl Schedule {
    /// What is due at `now` for an action last run at `last` (or created then, when it never
    /// ran): the latest slot in `(last, now]` unless it is more than `deadline` late
    /// (CronJob's `startingDeadlineSeconds`), and the next slot.
    pub fn due(
        &self,
        last: Timestamp,
        now: Timestamp,
        tz: &TimeZone,
        deadline: Option<SignedDuration>,
    ) -> Due {
        let latest = self.latest_in(last, now, tz);
        let late = |slot: Timestamp| deadline.is_some_and(|d| now.duration_since(slot) > d);
        Due {
            run: latest.filter(|s| !late(*s)),
            too_late: latest.filter(|s| late(*s)),
            next: self.next_after(now, tz),
        }
    }
}

fn next_unit(
    c: DateTime,
    unit: k8s_openapi::jiff::Span,
    truncate: impl Fn(DateTime) -> Result<DateTime, k8s_openapi::jiff::Error>,
) -> Option<DateTime> {
    truncate(c.checked_add(unit).ok()?).ok()
}

/// Looks up an IANA time zone (`Europe/Berlin`); empty or absent means UTC.
pub fn time_zone(name: Option<&str>) -> Result<TimeZone, String> {
    match name.map(str::trim) {
        None | Some("") | Some("UTC") | Some("Etc/UTC") => Ok(TimeZone::UTC),
        Some(n) => TimeZone::get(n)
            .map_err(|_| format!("unknown time zone {n:?} (expected an IANA name such as Europe/Berlin)")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small deterministic generator (xorshift) for the property tests, so a failing case
    /// reproduces without a seed file or an extra crate.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: u32) -> u32 {
            (self.next() % u64::from(n)) as u32
        }
        fn within(&mut self, lo: u32, hi: u32) -> u32 {
            lo + self.below(hi - lo + 1)
        }
    }

    #[test]
    fn due_runs_the_latest_missed_slot_once_unless_it_is_too_late() {
        let hourly: Schedule = "0 * * * *".parse().unwrap();
        let utc = TimeZone::UTC;
        let at = |s: &str| Some(ts(s));
        // Three slots missed: only the latest runs, and the next is the following hour.
        let d = hourly.due(ts("2026-01-01T10:00:00Z"), ts("2026-01-01T13:20:00Z"), &utc, None);
        assert_eq!(d.run, at("2026-01-01T13:00:00Z"));
        assert_eq!((d.too_late, d.next), (None, at("2026-01-01T14:00:00Z")));
        // Twenty minutes late with a five-minute deadline: skipped, and said so.
        let five = Some(SignedDuration::from_mins(5));
        let d = hourly.due(ts("2026-01-01T10:00:00Z"), ts("2026-01-01T13:20:00Z"), &utc, five);
        assert_eq!((d.run, d.too_late), (None, at("2026-01-01T13:00:00Z")));
        // On the slot itself, and within the deadline.
        let d = hourly.due(ts("2026-01-01T12:00:00Z"), ts("2026-01-01T13:00:00Z"), &utc, five);
        assert_eq!(d.run, at("2026-01-01T13:00:00Z"));
        // Already run for the latest slot: nothing until the next.
        let d = hourly.due(ts("2026-01-01T13:00:00Z"), ts("2026-01-01T13:20:00Z"), &utc, None);
        assert_eq!((d.run, d.too_late), (None, None));
        assert_eq!(d.next, at("2026-01-01T14:00:00Z"));
    }

    fn ts(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    fn next(expr: &str, after: &str, tz: &str) -> String {
        let s: Schedule = expr.parse().unwrap();
        let tz = time_zone(Some(tz)).unwrap();
        s.next_after(ts(after), &tz).unwrap().to_string()
    }

    #[test]
    fn five_fields_minute_granularity() {
        assert_eq!(
            next("*/15 * * * *", "2026-01-01T10:07:12Z", "UTC"),
            "2026-01-01T10:15:00Z"
        );
        assert_eq!(
            next("0 3 * * *", "2026-01-01T03:00:00Z", "UTC"),
            "2026-01-02T03:00:00Z"
        );
        assert_eq!(
            next("30 4 1,15 * *", "2026-01-02T00:00:00Z", "UTC"),
            "2026-01-15T04:30:00Z"
        );
    }

    #[test]
    fn six_fields_have_seconds_first() {
        assert_eq!(
            next("*/20 * * * * *", "2026-01-01T10:00:41Z", "UTC"),
            "2026-01-01T10:01:00Z"
        );
        assert_eq!(
            next("5 0 0 * * *", "2026-01-01T00:00:00Z", "UTC"),
            "2026-01-01T00:00:05Z"
        );
    }

    #[test]
    fn macros_names_and_sunday_as_seven() {
        assert_eq!(
            next("@hourly", "2026-01-01T10:59:59Z", "UTC"),
            "2026-01-01T11:00:00Z"
        );
        assert_eq!(
            next("@daily", "2026-01-01T10:00:00Z", "UTC"),
            "2026-01-02T00:00:00Z"
        );
        assert_eq!(
            next("@weekly", "2026-01-01T10:00:00Z", "UTC"),
            "2026-01-04T00:00:00Z"
        );
        assert_eq!(
            next("@monthly", "2026-01-31T10:00:00Z", "UTC"),
            "2026-02-01T00:00:00Z"
        );
        assert_eq!(
            next("@yearly", "2026-06-01T00:00:00Z", "UTC"),
            "2027-01-01T00:00:00Z"
        );
        // 2026-01-01 is a Thursday.
        assert_eq!(
            next("0 9 * * MON-FRI", "2026-01-02T10:00:00Z", "UTC"),
            "2026-01-05T09:00:00Z"
        );
        assert_eq!(
            next("0 9 * * 7", "2026-01-01T00:00:00Z", "UTC"),
            "2026-01-04T09:00:00Z"
        );
        assert_eq!(
            next("0 9 * * 6-7", "2026-01-01T00:00:00Z", "UTC"),
            "2026-01-03T09:00:00Z"
        );
        assert_eq!(
            next("0 0 1 FEB *", "2026-01-01T00:00:00Z", "UTC"),
            "2026-02-01T00:00:00Z"
        );
    }

    #[test]
    fn day_of_month_or_day_of_week_when_both_are_restricted() {
        // The 13th, or any Friday: 2026-02-06 is a Friday before the 13th.
        assert_eq!(
            next("0 0 13 * FRI", "2026-02-01T00:00:00Z", "UTC"),
            "2026-02-06T00:00:00Z"
        );
    }

    #[test]
    fn time_zones_shift_the_wall_clock() {
        assert_eq!(
            next("0 3 * * *", "2026-01-01T00:00:00Z", "Europe/Berlin"),
            "2026-01-01T02:00:00Z"
        );
        assert_eq!(
            next("0 3 * * *", "2026-07-01T00:00:00Z", "Europe/Berlin"),
            "2026-07-01T01:00:00Z"
        );
    }

    #[test]
    fn a_skipped_wall_clock_time_fires_once_after_the_gap() {
        // US spring forward 2026-03-08: 02:00 EST becomes 03:00 EDT; 02:30 does not exist.
        let tz = "America/New_York";
        assert_eq!(
            next("30 2 * * *", "2026-03-08T05:00:00Z", tz),
            "2026-03-08T07:30:00Z"
        ); // 03:30 EDT
        assert_eq!(
            next("30 2 * * *", "2026-03-08T07:30:00Z", tz),
            "2026-03-09T06:30:00Z"
        ); // 02:30 EDT
        // Every 15 minutes: the skipped hour's slots collapse into the first instant after it.
        assert_eq!(
            next("*/15 * * * *", "2026-03-08T06:45:00Z", tz),
            "2026-03-08T07:00:00Z"
        ); // 03:00 EDT
        assert_eq!(
            next("*/15 * * * *", "2026-03-08T07:00:00Z", tz),
            "2026-03-08T07:15:00Z"
        );
    }

    #[test]
    fn a_repeated_wall_clock_time_fires_only_once() {
        // US fall back 2026-11-01: 01:00-02:00 happens twice (EDT, then EST).
        let tz = "America/New_York";
        let first = next("30 1 * * *", "2026-11-01T04:00:00Z", tz);
        assert_eq!(first, "2026-11-01T05:30:00Z"); // 01:30 EDT
        // From the first 01:30, and from inside the repeated hour, the next is the next day.
        assert_eq!(next("30 1 * * *", &first, tz), "2026-11-02T06:30:00Z");
        assert_eq!(
            next("30 1 * * *", "2026-11-01T06:10:00Z", tz),
            "2026-11-02T06:30:00Z"
        );
    }

    #[test]
    fn bad_expressions_say_what_is_wrong() {
        for (bad, says) in [
            ("* * * *", "4 fields"),
            ("61 * * * *", "minute: 61 is outside 0-59"),
            ("* 24 * * *", "hour"),
            ("* * 0 * *", "day-of-month"),
            ("* * * 13 *", "month"),
            ("* * * * 8", "day-of-week"),
            ("*/0 * * * *", "step"),
            ("5-1 * * * *", "backwards"),
            ("@fortnightly", "unknown macro"),
            ("x * * * *", "not a number"),
        ] {
            let err = bad.parse::<Schedule>().unwrap_err();
            assert!(err.contains(says), "{bad:?}: {err}");
        }
    }

    #[test]
    fn a_schedule_that_never_fires_has_no_next_slot() {
        let s: Schedule = "0 0 30 2 *".parse().unwrap();
        assert_eq!(s.next_after(ts("2026-01-01T00:00:00Z"), &TimeZone::UTC), None);
    }

    #[test]
    fn latest_slot_in_a_window() {
        let s: Schedule = "0 * * * *".parse().unwrap();
        let tz = TimeZone::UTC;
        let latest = s.latest_in(ts("2026-01-01T00:30:00Z"), ts("2026-01-01T05:10:00Z"), &tz);
        assert_eq!(latest, Some(ts("2026-01-01T05:00:00Z")));
        assert_eq!(
            s.latest_in(ts("2026-01-01T05:00:00Z"), ts("2026-01-01T05:59:59Z"), &tz),
            None
        );
        // Every second for a month: still answered, from a later starting point.
        let every: Schedule = "* * * * * *".parse().unwrap();
        let latest = every.latest_in(ts("2026-01-01T00:00:00Z"), ts("2026-02-01T00:00:00Z"), &tz);
        assert_eq!(latest, Some(ts("2026-02-01T00:00:00Z")));
        // Every second in the morning, looked at in the afternoon after a day away.
        let mornings: Schedule = "* * 0-11 * * *".parse().unwrap();
        for (after, until) in [
            ("2025-12-31T13:30:00Z", "2026-01-01T13:30:00Z"),
            ("2025-12-31T13:30:00Z", "2026-01-01T23:59:00Z"),
            ("2025-12-25T00:00:00Z", "2026-01-01T13:30:00Z"),
        ] {
            assert_eq!(
                mornings.latest_in(ts(after), ts(until), &tz),
                Some(ts("2026-01-01T11:59:59Z")),
                "({after}, {until}]"
            );
        }
    }

    #[test]
    fn unknown_time_zones_are_refused() {
        assert!(
            time_zone(Some("Mars/Olympus"))
                .unwrap_err()
                .contains("Mars/Olympus")
        );
        assert_eq!(time_zone(None).unwrap(), TimeZone::UTC);
    }

    #[test]
    fn a_huge_step_ends_the_walk_instead_of_overflowing() {
        let s: Schedule = "5/4294967295 * * * *".parse().unwrap();
        let next = s.next_after(ts("2026-01-01T00:07:00Z"), &TimeZone::UTC).unwrap();
        assert_eq!(next, ts("2026-01-01T01:05:00Z"));
        let err = "*/4294967296 * * * *".parse::<Schedule>().unwrap_err();
        assert!(err.contains("step"), "{err}");
    }

    /// A random field over `lo..=hi` and the values it stands for, expanded independently of
    /// the parser; `true` when it is a bare `*` (unrestricted).
    fn random_field(r: &mut Rng, lo: u32, hi: u32) -> (String, Vec<u32>, bool) {
        let all: Vec<u32> = (lo..=hi).collect();
        match r.below(6) {
            0 => ("*".into(), all, true),
            1 => {
                let a = r.within(lo, hi);
                (a.to_string(), vec![a], false)
            }
            2 => {
                let (a, b) = (r.within(lo, hi), r.within(lo, hi));
                let (a, b) = (a.min(b), a.max(b));
                (format!("{a}-{b}"), (a..=b).collect(), false)
            }
            3 => {
                let st = r.within(1, hi - lo + 2);
                let v = (lo..=hi).step_by(st as usize).collect();
                (format!("*/{st}"), v, false)
            }
            4 => {
                let (a, b) = (r.within(lo, hi), r.within(lo, hi));
                let (a, b) = (a.min(b), a.max(b));
                let st = r.within(1, 5);
                (
                    format!("{a}-{b}/{st}"),
                    (a..=b).step_by(st as usize).collect(),
                    false,
                )
            }
            _ => {
                let (a, b) = (r.within(lo, hi), r.within(lo, hi));
                let mut v = vec![a, b];
                v.sort();
                v.dedup();
                (format!("{a},{b}"), v, false)
            }
        }
    }

    #[test]
    fn next_slot_matches_a_brute_force_search_over_random_schedules() {
        let mut r = Rng(0x9e37_79b9_7f4a_7c15);
        let zones = [
            TimeZone::UTC,
            TimeZone::fixed(k8s_openapi::jiff::tz::offset(5)),
            TimeZone::get("America/New_York").unwrap(),
            TimeZone::get("Asia/Shanghai").unwrap(),
        ];
        for case in 0..300 {
            let seconds_field = case % 4 == 0;
            let (sec, secs, _) = if seconds_field {
                random_field(&mut r, 0, 59)
            } else {
                ("0".into(), vec![0], false)
            };
            let (min, mins, _) = random_field(&mut r, 0, 59);
            let (hour, hours, _) = random_field(&mut r, 0, 23);
            let (dom, doms, dom_star) = random_field(&mut r, 1, 31);
            let (mon, mons, _) = if r.below(3) == 0 {
                random_field(&mut r, 1, 12)
            } else {
                ("*".into(), (1..=12).collect(), true)
            };
            let (dow, dows, dow_star) = random_field(&mut r, 0, 6);
            let expr = if seconds_field {
                format!("{sec} {min} {hour} {dom} {mon} {dow}")
            } else {
                format!("{min} {hour} {dom} {mon} {dow}")
            };
            let schedule: Schedule = expr.parse().unwrap_or_else(|e| panic!("{expr}: {e}"));
            let tz = &zones[case as usize % zones.len()];
            // Start times away from DST changes (mid-January, mid-June): the brute force reads
            // wall clocks, which repeat or skip around a change.
            let start = if case % 2 == 0 {
                "2026-01-10T00:00:00Z"
            } else {
                "2026-06-10T00:00:00Z"
            };
            let t = ts(start)
                .checked_add((i64::from(r.below(3 * 86_400))).seconds())
                .unwrap();
            let matches = |at: Timestamp| {
                let d = tz.to_datetime(at);
                let (dom_ok, dow_ok) = (
                    doms.contains(&(d.day() as u32)),
                    dows.contains(&(d.weekday().to_sunday_zero_offset() as u32)),
                );
                let day_ok = match (dom_star, dow_star) {
                    (false, false) => dom_ok || dow_ok,
                    (false, true) => dom_ok,
                    (true, false) => dow_ok,
                    (true, true) => true,
                };
                secs.contains(&(d.second() as u32))
                    && mins.contains(&(d.minute() as u32))
                    && hours.contains(&(d.hour() as u32))
                    && mons.contains(&(d.month() as u32))
                    && day_ok
            };
            // Seconds schedules are searched second by second for a day, the others minute by
            // minute for two weeks.
            let (step, horizon) = if seconds_field {
                (1, 86_400)
            } else {
                (60, 14 * 86_400)
            };
            let base = t.as_second() - t.as_second().rem_euclid(step);
            let want = (1..=horizon / step)
                .map(|k| Timestamp::from_second(base + k * step).unwrap())
                .filter(|c| *c > t)
                .find(|c| matches(*c));
            let got = schedule.next_after(t, tz);
            match want {
                Some(w) => assert_eq!(got, Some(w), "{expr} in {tz:?} after {t}"),
                None => assert!(
                    got.is_none_or(|g| g.as_second() > base + horizon),
                    "{expr} in {tz:?} after {t}: got {got:?}, brute force found nothing"
                ),
            }
        }
    }

    #[test]
    fn random_token_soup_parses_or_is_refused_without_panicking() {
        let tokens = [
            "*",
            "?",
            "/",
            ",",
            "-",
            "0",
            "1",
            "7",
            "23",
            "31",
            "59",
            "60",
            "4294967295",
            "99999999999",
            "JAN",
            "mon",
            "@",
            "daily",
            "@hourly",
            " ",
            " ",
            " ",
            "x",
            "",
            "-1",
        ];
        let mut r = Rng(0xdead_beef_cafe_f00d);
        let mut parsed = 0;
        for _ in 0..20_000 {
            let n = 1 + r.below(24) as usize;
            let expr: String = (0..n)
                .map(|_| tokens[r.below(tokens.len() as u32) as usize])
                .collect();
            if let Ok(s) = expr.parse::<Schedule>() {
                parsed += 1;
                let t = ts("2026-03-08T06:59:59Z");
                let _ = s.next_after(t, &TimeZone::get("America/New_York").unwrap());
                let _ = s.latest_in(t, ts("2026-03-09T06:59:59Z"), &TimeZone::UTC);
            }
        }
        // The soup is not all refused: parsed schedules were exercised too.
        assert!(parsed > 20, "{parsed}");
    }
}
