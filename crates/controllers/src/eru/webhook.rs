//! Eru admission: the schedule and time zone are fully parsed (CEL only checks their shape),
//! and a missing target Deployment is warned about.
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use opkit::webhook::{FailurePolicy, Review, Rule, Verdict, Webhooks};
use opkit_api::eru::Eru;

/// Checks an Eru's schedule and time zone fully; `deployment_exists` answers for the target.
pub fn validate_eru(eru: &Eru, deployment_exists: Option<bool>) -> Verdict {
    if let Err((_, msg)) = super::check_spec(&eru.spec, Timestamp::now()) {
        return Verdict::deny(msg);
    }
    match deployment_exists {
        Some(false) => Verdict::allow().warn(format!(
            "Deployment {} does not exist (yet); nothing is restarted until it does",
            eru.spec.deployment_name
        )),
        _ => Verdict::allow(),
    }
}

/// Adds the Eru webhooks.
pub fn webhooks(w: Webhooks) -> Webhooks {
    let rule = Rule::validating::<Eru>()
        // Ignore: the controller checks the same spec and reports an impossible schedule as a
        // condition and a Warning Event; nothing restarts off schedule, so an outage only moves
        // the message from `kubectl apply` to `kubectl describe`.
        .failure_policy(FailurePolicy::Ignore);
    w.validating(rule, |r: Review<Eru>| async move {
        let Some(eru) = &r.object else {
            return Verdict::allow();
        };
        // Unknown (no client, an API error) is not a reason to refuse or warn.
        let exists = match r.client() {
            Some(client) => {
                let ns = r.namespace.as_deref().unwrap_or_default();
                let deploys: Api<Deployment> = Api::namespaced(client.clone(), ns);
                deploys
                    .get_opt(&eru.spec.deployment_name)
                    .await
                    .ok()
                    .map(|d| d.is_some())
            }
            None => None,
        };
        validate_eru(eru, exists)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use opkit_api::eru::EruSpec;

    #[test]
    fn eru_schedules_are_parsed_fully_and_missing_targets_warned() {
        let eru = |s: &str| {
            Eru::new(
                "e",
                EruSpec {
                    deployment_name: "web".into(),
                    schedule: s.into(),
                    time_zone: None,
                    suspend: None,
                    starting_deadline_seconds: None,
                },
            )
        };
        assert!(
            validate_eru(&eru("61 * * * *"), Some(true))
                .denied
                .unwrap()
                .contains("minute: 61")
        );
        assert!(
            validate_eru(&eru("0 0 30 2 *"), Some(true))
                .denied
                .unwrap()
                .contains("never fires")
        );
        let v = validate_eru(&eru("@daily"), Some(false));
        assert!(v.denied.is_none() && v.warnings[0].contains("web does not exist"));
        assert_eq!(validate_eru(&eru("@daily"), Some(true)), Verdict::allow());
    }
}
