//! Any string: the cron parser returns a schedule or an error, never panics, and a parsed
//! schedule's next and latest slots are computed without panicking, in a zone with DST.
#![no_main]

use k8s_openapi::jiff::Timestamp;
use k8s_openapi::jiff::tz::TimeZone;
use libfuzzer_sys::fuzz_target;
use opkit_controllers::eru::{Schedule, time_zone};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    // The first line may name a time zone; the rest is the schedule.
    let (zone, expr) = text.split_once('\n').unwrap_or(("", text));
    let tz = time_zone(Some(zone).filter(|z| !z.is_empty())).unwrap_or(TimeZone::UTC);
    if let Ok(s) = expr.parse::<Schedule>() {
        let t = Timestamp::from_second(1_772_953_199).unwrap_or(Timestamp::UNIX_EPOCH);
        if let Some(n) = s.next_after(t, &tz) {
            assert!(n > t);
        }
        let until = Timestamp::from_second(1_773_039_599).unwrap_or(t);
        if let Some(l) = s.latest_in(t, until, &tz) {
            assert!(l > t && l <= until);
        }
    }
});
