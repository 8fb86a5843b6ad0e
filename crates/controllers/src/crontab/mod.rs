//! `CronTab`: the documentation's example kind, served in `v1` and `v2` with different schemas.
//! There is nothing to reconcile; what opkit adds is the conversion between the versions:
//! `v2` (stored) is the hub, `v1` its spoke. `v1`'s `cronSpec` becomes `v2`'s five schedule
//! fields; a `cronSpec` that is not five fields (`@hourly`) cannot be stored and is refused,
//! naming the field. `v2`'s `timeZone` (absent in `v1`) and `v1`'s spacing inside `cronSpec`
//! survive a trip through the other version (opkit keeps them in an annotation).
use k8s_openapi::api::rbac::v1::PolicyRule;
use opkit::conversion::{Conversion, ConversionError};
use opkit::webhook::Webhooks;
use opkit_api::crontab::{v1, v2};

/// The name `--controllers` selects it by.
pub const NAME: &str = "crontab";

/// `v1` → `v2`: the schedule split into its fields.
pub fn to_hub(c: &v1::CronTab) -> Result<v2::CronTab, ConversionError> {
    let fields: Vec<&str> = c.spec.cron_spec.split_whitespace().collect();
    let [minute, hour, day_of_month, month, day_of_week] = fields[..] else {
        return Err(ConversionError::field(
            "spec.cronSpec",
            format!(
                "{:?} has {} field{}; v2 stores five (minute hour day-of-month month day-of-week), so it cannot be stored",
                c.spec.cron_spec,
                fields.len(),
                if fields.len() == 1 { "" } else { "s" }
            ),
        ));
    };
    let spec = v2::CronTabSpec {
        schedule: v2::Schedule {
            minute: minute.into(),
            hour: hour.into(),
            day_of_month: day_of_month.into(),
            month: month.into(),
            day_of_week: day_of_week.into(),
        },
        time_zone: None,
        image: c.spec.image.clone(),
        replicas: c.spec.replicas,
    };
    Ok(v2::CronTab {
        metadata: c.metadata.clone(),
        spec,
    })
}

/// `v2` → `v1`: the fields joined into one `cronSpec`.
pub fn from_hub(c: &v2::CronTab) -> Result<v1::CronTab, ConversionError> {
    let s = &c.spec.schedule;
    let spec = v1::CronTabSpec {
        cron_spec: [&s.minute, &s.hour, &s.day_of_month, &s.month, &s.day_of_week]
            .map(String::as_str)
            .join(" "),
        image: c.spec.image.clone(),
        replicas: c.spec.replicas,
    };
    Ok(v1::CronTab {
        metadata: c.metadata.clone(),
        spec,
    })
}

/// How the versions convert.
pub fn conversion() -> Conversion {
    Conversion::hub::<v2::CronTab>().spoke(to_hub, from_hub)
}

/// The conversion webhook.
pub fn webhooks(w: Webhooks) -> Webhooks {
    w.conversion(conversion())
}

/// Nothing is reconciled; the conversion webhook's own rights come with it.
pub fn rbac_rules() -> Vec<PolicyRule> {
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_rng::Rng;
    use serde_json::{Value, json};

    fn v1(name: &str, spec: Value) -> Value {
        json!({"apiVersion": "stable.example.com/v1", "kind": "CronTab",
               "metadata": {"name": name, "namespace": "ns", "uid": "u", "resourceVersion": "7",
                            "labels": {"app": "x"}},
               "spec": spec})
    }

    #[test]
    fn v1_and_v2_convert_both_ways_keeping_metadata() {
        let c = conversion();
        let one = v1(
            "a",
            json!({"cronSpec": "*/5 * * * *", "image": "busybox", "replicas": 2}),
        );
        let two = c.convert(&one, "stable.example.com/v2").unwrap();
        assert_eq!(two["apiVersion"], "stable.example.com/v2");
        assert_eq!(two["metadata"], one["metadata"]);
        assert_eq!(
            two["spec"],
            json!({"schedule": {"minute": "*/5", "hour": "*", "dayOfMonth": "*", "month": "*", "dayOfWeek": "*"},
                   "image": "busybox", "replicas": 2})
        );
        assert_eq!(c.convert(&two, "stable.example.com/v1").unwrap(), one);
    }

    #[test]
    fn a_cron_spec_that_is_not_five_fields_is_refused_naming_the_field() {
        let err = conversion()
            .convert(
                &v1("b", json!({"cronSpec": "@hourly", "image": "busybox"})),
                "stable.example.com/v2",
            )
            .unwrap_err();
        assert!(
            err.0.starts_with("spec.cronSpec: \"@hourly\" has 1 field;"),
            "{err}"
        );
    }

    #[test]
    fn what_the_other_version_cannot_say_survives_the_trip() {
        let c = conversion();
        // v2's time zone through v1 and back.
        let two = json!({"apiVersion": "stable.example.com/v2", "kind": "CronTab",
            "metadata": {"name": "c", "namespace": "ns"},
            "spec": {"schedule": {"minute": "0", "hour": "3", "dayOfMonth": "*", "month": "*", "dayOfWeek": "1"},
                     "timeZone": "Europe/Paris", "image": "busybox"}});
        let one = c.convert(&two, "stable.example.com/v1").unwrap();
        assert_eq!(one["spec"]["cronSpec"], "0 3 * * 1");
        assert!(one["metadata"]["annotations"]["conversion.opkit.dev/v2"].is_string());
        assert_eq!(c.convert(&one, "stable.example.com/v2").unwrap(), two);
        // Changed in v1 meanwhile: the change is kept, and so is the time zone.
        let mut edited = one.clone();
        edited["spec"]["cronSpec"] = json!("30 3 * * 1");
        let back = c.convert(&edited, "stable.example.com/v2").unwrap();
        assert_eq!(back["spec"]["schedule"]["minute"], "30");
        assert_eq!(back["spec"]["timeZone"], "Europe/Paris");
        assert!(back["metadata"].get("annotations").is_none(), "{back}");
        // v1's spacing through v2 and back.
        let spaced = v1("d", json!({"cronSpec": "0  3 * * 1", "image": "busybox"}));
        let stored = c.convert(&spaced, "stable.example.com/v2").unwrap();
        assert_eq!(c.convert(&stored, "stable.example.com/v1").unwrap(), spaced);
    }

    #[test]
    fn kept_content_that_no_longer_reads_is_ignored_not_fatal() {
        let c = conversion();
        for kept in ["{\"spec\":{}}", "not json", "[1]"] {
            let mut one = v1("e", json!({"cronSpec": "0 1 * * *", "image": "i"}));
            one["metadata"]["annotations"] = json!({"conversion.opkit.dev/v2": kept});
            let two = c.convert(&one, "stable.example.com/v2").unwrap();
            assert_eq!(two["spec"]["schedule"]["hour"], "1", "{kept}");
            assert!(two["metadata"].get("annotations").is_none(), "{two}");
        }
    }

    #[test]
    fn a_review_converts_a_list_of_mixed_versions_in_order_or_names_the_object_that_failed() {
        let c = [conversion()];
        // What `convert` signs with.
        let key = opkit::conversion::SigningKey::process();
        let one = v1("a", json!({"cronSpec": "0 * * * *", "image": "i"}));
        let two = c[0]
            .convert(
                &v1("b", json!({"cronSpec": "5 * * * *", "image": "i"})),
                "stable.example.com/v2",
            )
            .unwrap();
        let out =
            opkit::conversion::convert_all(&c, &[one.clone(), two.clone()], "stable.example.com/v1", &key)
                .unwrap();
        assert_eq!(out[0], one);
        assert_eq!(out[1]["metadata"]["name"], "b");
        assert_eq!(out[1]["spec"]["cronSpec"], "5 * * * *");
        let bad = v1("c", json!({"cronSpec": "@daily", "image": "i"}));
        let err = opkit::conversion::convert_all(&c, &[one, bad], "stable.example.com/v2", &key).unwrap_err();
        assert!(
            err.0.starts_with(
                "converting CronTab c from stable.example.com/v1 to stable.example.com/v2: spec.cronSpec"
            ),
            "{err}"
        );
        let other = json!({"apiVersion": "example.com/v1", "kind": "Thing", "metadata": {"name": "t"}});
        let err = opkit::conversion::convert_all(&c, &[other], "example.com/v2", &key).unwrap_err();
        assert!(err.0.contains("no conversion of Thing"), "{err}");
    }

    #[test]
    fn every_generated_object_round_trips_through_the_other_version() {
        let c = conversion();
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        let fields = ["*", "0", "*/5", "1-5", "0,30", "12"];
        let zones = ["", "UTC", "Europe/Paris", "Asia/Shanghai"];
        for i in 0..2000 {
            let f: Vec<&str> = (0..5).map(|_| rng.pick(&fields)).collect();
            let sep = rng.pick(&[" ", "  ", "\t"]);
            let replicas = (!rng.next().is_multiple_of(3)).then(|| (rng.next() % 10) as i32);
            let mut spec = json!({"image": rng.pick(&["busybox", "nginx:1.27"])});
            if let Some(r) = replicas {
                spec["replicas"] = json!(r);
            }
            let one = {
                let mut s = spec.clone();
                s["cronSpec"] = json!(f.join(sep));
                v1(&format!("o{i}"), s)
            };
            let there = c.convert(&one, "stable.example.com/v2").unwrap();
            assert_eq!(c.convert(&there, "stable.example.com/v1").unwrap(), one, "{one}");
            let mut two = json!({"apiVersion": "stable.example.com/v2", "kind": "CronTab",
                "metadata": {"name": format!("t{i}"), "namespace": "ns"}, "spec": spec});
            two["spec"]["schedule"] = json!({"minute": f[0], "hour": f[1], "dayOfMonth": f[2],
                "month": f[3], "dayOfWeek": f[4]});
            let zone = rng.pick(&zones);
            if !zone.is_empty() {
                two["spec"]["timeZone"] = json!(zone);
            }
            let there = c.convert(&two, "stable.example.com/v1").unwrap();
            assert_eq!(c.convert(&there, "stable.example.com/v2").unwrap(), two, "{two}");
        }
    }
}
