//! Admission webhooks for opkit's kinds: what the CRD schema and CEL cannot say.
//!
//! - `Memcached` (mutating): a missing `spec.size` is defaulted to [`DEFAULT_SIZE`].
//! - `At` (validating): a schedule more than [`AT_HORIZON_YEARS`] years in the past is refused
//!   (almost certainly a typo), one merely in the past gets a warning (it runs at once); the
//!   spec cannot change once the At has started.
//! - `Eru` (validating): the schedule is fully parsed (CEL only checks its shape) and a missing
//!   target Deployment is warned about.
//!
//! Every webhook uses `failurePolicy: Ignore`: each rule is also enforced further down (the
//! schema requires `size`; the controllers report bad schedules as conditions and Events), so
//! an operator outage never blocks anyone's `kubectl apply`.
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhook, MutatingWebhookConfiguration, RuleWithOperations, ServiceReference, ValidatingWebhook,
    ValidatingWebhookConfiguration, WebhookClientConfig,
};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::rbac::v1::PolicyRule;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::core::DynamicObject;
use kube::core::admission::Operation;
use kube::{Api, Client};
use opkit::webhook::{Review, Verdict, Webhooks};
use opkit_api::at::{At, Phase};
use opkit_api::eru::Eru;

use crate::rbac::rule;

/// `spec.size` given to a Memcached created without one.
pub const DEFAULT_SIZE: i32 = 1;
/// How far in the past an At may be scheduled when created. Generous on purpose: the book's
/// sample is scheduled for 2019 and must keep working.
pub const AT_HORIZON_YEARS: i64 = 10;
/// Names of the generated webhook configurations.
pub const MUTATING: &str = "opkit-mutating-webhook-configuration";
pub const VALIDATING: &str = "opkit-validating-webhook-configuration";
/// The Service in front of the operator's webhook server (in-cluster).
pub const SERVICE: &str = "opkit-webhook-service";
/// Webhook paths.
pub const MUTATE_MEMCACHED: &str = "/mutate-cache-example-com-memcached";
pub const VALIDATE_AT: &str = "/validate-cnat-programming-kubernetes-info-at";
pub const VALIDATE_ERU: &str = "/validate-mtsre-meitu-com-eru";

/// Defaults `spec.size` of a Memcached that has none.
pub fn default_memcached(obj: &DynamicObject) -> Verdict {
    let spec = &obj.data["spec"];
    if !spec["size"].is_null() {
        return Verdict::allow();
    }
    let op = if spec.is_object() {
        json_patch::PatchOperation::Add(json_patch::AddOperation {
            path: json_patch::jsonptr::PointerBuf::from_tokens(["spec", "size"]),
            value: serde_json::json!(DEFAULT_SIZE),
        })
    } else {
        json_patch::PatchOperation::Add(json_patch::AddOperation {
            path: json_patch::jsonptr::PointerBuf::from_tokens(["spec"]),
            value: serde_json::json!({"size": DEFAULT_SIZE}),
        })
    };
    Verdict {
        patch: vec![op],
        ..Default::default()
    }
}

/// Checks an At on create (schedule horizon) and update (immutable once started).
pub fn validate_at(review: &Review<At>, now: Timestamp) -> Verdict {
    let Some(at) = &review.object else {
        return Verdict::allow();
    };
    match review.operation {
        Operation::Create => {
            let Ok(when) = crate::at::parse_schedule(&at.spec.schedule) else {
                // The CRD's CEL rule explains a malformed schedule better.
                return Verdict::allow();
            };
            let horizon = SignedDuration::from_hours(24 * 365 * AT_HORIZON_YEARS);
            let ago = now.duration_since(when);
            if ago > horizon {
                return Verdict::deny(format!(
                    "spec.schedule {} is more than {AT_HORIZON_YEARS} years in the past; check the year",
                    at.spec.schedule
                ));
            }
            if ago > SignedDuration::ZERO {
                return Verdict::allow().warn(format!(
                    "spec.schedule {} is in the past: the command runs at once",
                    at.spec.schedule
                ));
            }
            Verdict::allow()
        }
        Operation::Update => {
            let Some(old) = &review.old_object else {
                return Verdict::allow();
            };
            let phase = old.status.as_ref().and_then(|s| s.phase).unwrap_or_default();
            if phase != Phase::Pending && old.spec != at.spec {
                let phase = serde_json::to_value(phase).unwrap_or_default();
                return Verdict::deny(format!(
                    "spec is immutable once the At has started (phase {}); create a new At to run another command",
                    phase.as_str().unwrap_or("?")
                ));
            }
            Verdict::allow()
        }
        _ => Verdict::allow(),
    }
}

/// Checks an Eru's schedule and time zone fully; `deployment_exists` answers for the target.
pub fn validate_eru(eru: &Eru, deployment_exists: Option<bool>) -> Verdict {
    if let Err((_, msg)) = crate::eru::check_spec(&eru.spec, Timestamp::now()) {
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

/// The handlers, ready to serve.
pub fn webhooks(client: Client) -> Webhooks {
    Webhooks::new()
        .handle::<DynamicObject, _, _>(MUTATE_MEMCACHED, |r: Review<DynamicObject>| async move {
            match (&r.operation, &r.object) {
                (Operation::Create, Some(o)) => default_memcached(o),
                _ => Verdict::allow(),
            }
        })
        .handle::<At, _, _>(VALIDATE_AT, |r: Review<At>| async move {
            validate_at(&r, Timestamp::now())
        })
        .handle::<Eru, _, _>(VALIDATE_ERU, move |r: Review<Eru>| {
            let client = client.clone();
            async move {
                let Some(eru) = &r.object else {
                    return Verdict::allow();
                };
                let ns = r.namespace.clone().unwrap_or_default();
                let deploys: Api<Deployment> = Api::namespaced(client, &ns);
                // Unknown (API error) is not a reason to refuse or warn.
                let exists = deploys
                    .get_opt(&eru.spec.deployment_name)
                    .await
                    .ok()
                    .map(|d| d.is_some());
                validate_eru(eru, exists)
            }
        })
}

/// Where the apiserver reaches the webhook server.
#[derive(Clone, Debug)]
pub enum Endpoint {
    /// The in-cluster Service `opkit-webhook-service` in `namespace`.
    Service { namespace: String },
    /// A URL base such as `https://127.0.0.1:9443` (operator running outside the cluster).
    Url(String),
}

fn client_config(endpoint: &Endpoint, path: &str, ca_bundle: Option<&str>) -> WebhookClientConfig {
    WebhookClientConfig {
        ca_bundle: ca_bundle.map(|c| k8s_openapi::ByteString(c.as_bytes().to_vec())),
        service: match endpoint {
            Endpoint::Service { namespace } => Some(ServiceReference {
                name: SERVICE.into(),
                namespace: namespace.clone(),
                path: Some(path.into()),
                port: Some(443),
            }),
            Endpoint::Url(_) => None,
        },
        url: match endpoint {
            Endpoint::Url(base) => Some(format!("{}{path}", base.trim_end_matches('/'))),
            Endpoint::Service { .. } => None,
        },
    }
}

fn rules(group: &str, versions: &[&str], resource: &str, ops: &[&str]) -> Option<Vec<RuleWithOperations>> {
    let s = |v: &[&str]| Some(v.iter().map(|x| x.to_string()).collect());
    Some(vec![RuleWithOperations {
        api_groups: s(&[group]),
        api_versions: s(versions),
        operations: s(ops),
        resources: s(&[resource]),
        scope: Some("Namespaced".into()),
    }])
}

/// Keeps the operator's own namespace out, so a broken webhook can never block fixing it.
fn namespace_selector(own_namespace: &str) -> Option<LabelSelector> {
    Some(LabelSelector {
        match_expressions: Some(vec![LabelSelectorRequirement {
            key: "kubernetes.io/metadata.name".into(),
            operator: "NotIn".into(),
            values: Some(vec![own_namespace.into()]),
        }]),
        ..Default::default()
    })
}

/// The two webhook configurations, pointing at `endpoint`, trusting `ca_bundle` (PEM) if given.
pub fn configurations(
    endpoint: &Endpoint,
    own_namespace: &str,
    ca_bundle: Option<&str>,
) -> (MutatingWebhookConfiguration, ValidatingWebhookConfiguration) {
    let meta = |name: &str| ObjectMeta {
        name: Some(name.into()),
        ..Default::default()
    };
    let common_versions = vec!["v1".to_string()];
    let mutating = MutatingWebhookConfiguration {
        metadata: meta(MUTATING),
        webhooks: Some(vec![MutatingWebhook {
            name: "mmemcached.opkit.dev".into(),
            client_config: client_config(endpoint, MUTATE_MEMCACHED, ca_bundle),
            rules: rules(
                "cache.example.com",
                &["v1", "v1alpha1"],
                "memcacheds",
                &["CREATE"],
            ),
            failure_policy: Some("Ignore".into()),
            side_effects: "None".into(),
            admission_review_versions: common_versions.clone(),
            timeout_seconds: Some(5),
            match_policy: Some("Equivalent".into()),
            namespace_selector: namespace_selector(own_namespace),
            reinvocation_policy: Some("Never".into()),
            ..Default::default()
        }]),
    };
    let validating = |name: &str, path: &str, group: &str, version: &str, resource: &str| ValidatingWebhook {
        name: name.into(),
        client_config: client_config(endpoint, path, ca_bundle),
        rules: rules(group, &[version], resource, &["CREATE", "UPDATE"]),
        failure_policy: Some("Ignore".into()),
        side_effects: "None".into(),
        admission_review_versions: common_versions.clone(),
        timeout_seconds: Some(5),
        match_policy: Some("Equivalent".into()),
        namespace_selector: namespace_selector(own_namespace),
        ..Default::default()
    };
    let validating = ValidatingWebhookConfiguration {
        metadata: meta(VALIDATING),
        webhooks: Some(vec![
            validating(
                "vat.opkit.dev",
                VALIDATE_AT,
                "cnat.programming-kubernetes.info",
                "v1alpha1",
                "ats",
            ),
            validating("veru.opkit.dev", VALIDATE_ERU, "mtsre.meitu.com", "v1", "erus"),
        ]),
    };
    (mutating, validating)
}

/// What the operator needs to keep the configurations' `caBundle` (and endpoint) current.
pub fn rbac_rules() -> Vec<PolicyRule> {
    [
        ("mutatingwebhookconfigurations", MUTATING),
        ("validatingwebhookconfigurations", VALIDATING),
    ]
    .map(|(resource, name)| PolicyRule {
        resource_names: Some(vec![name.into()]),
        ..rule(&["admissionregistration.k8s.io"], &[resource], &["get", "patch"])
    })
    .to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;
    use opkit_api::at::{AtSpec, AtStatus};
    use opkit_api::eru::EruSpec;

    fn at(schedule: &str, phase: Option<Phase>) -> At {
        let mut a = At::new(
            "a",
            AtSpec {
                schedule: schedule.into(),
                command: "echo YAY".into(),
                image: None,
            },
        );
        a.status = phase.map(|p| AtStatus {
            phase: Some(p),
            ..Default::default()
        });
        a
    }

    fn review(op: Operation, new: At, old: Option<At>) -> Review<At> {
        Review {
            operation: op,
            object: Some(new),
            old_object: old,
            namespace: Some("ns".into()),
        }
    }

    #[test]
    fn a_memcached_without_size_is_defaulted() {
        let o: DynamicObject = serde_json::from_value(serde_json::json!({
            "apiVersion": "cache.example.com/v1", "kind": "Memcached", "metadata": {"name": "m"}, "spec": {}
        }))
        .unwrap();
        let v = default_memcached(&o);
        assert_eq!(v.patch.len(), 1);
        let mut doc = serde_json::to_value(&o).unwrap();
        json_patch::patch(&mut doc, &v.patch).unwrap();
        assert_eq!(doc["spec"]["size"], DEFAULT_SIZE);
        let with_size: DynamicObject = serde_json::from_value(serde_json::json!({
            "apiVersion": "cache.example.com/v1", "kind": "Memcached", "metadata": {"name": "m"}, "spec": {"size": 3}
        }))
        .unwrap();
        assert!(default_memcached(&with_size).patch.is_empty());
    }

    #[test]
    fn at_schedules_far_in_the_past_are_refused_and_recent_ones_warned() {
        let now: Timestamp = "2026-11-22T00:00:00Z".parse().unwrap();
        let v = validate_at(
            &review(Operation::Create, at("2015-01-01T00:00:00Z", None), None),
            now,
        );
        assert!(v.denied.unwrap().contains("more than 10 years"));
        let v = validate_at(
            &review(Operation::Create, at("2019-04-12T10:12:00Z", None), None),
            now,
        );
        assert!(v.denied.is_none());
        assert!(v.warnings[0].contains("runs at once"));
        let v = validate_at(
            &review(Operation::Create, at("2027-01-01T00:00:00Z", None), None),
            now,
        );
        assert_eq!(v, Verdict::allow());
    }

    #[test]
    fn an_at_that_has_started_cannot_change() {
        let now = Timestamp::now();
        let old = at("2019-04-12T10:12:00Z", Some(Phase::Done));
        let mut new = old.clone();
        new.spec.command = "echo NAY".into();
        let v = validate_at(&review(Operation::Update, new, Some(old.clone())), now);
        assert!(v.denied.unwrap().contains("phase DONE"));
        let mut pending = old.clone();
        pending.status = None;
        let mut new = pending.clone();
        new.spec.command = "echo NAY".into();
        assert!(
            validate_at(&review(Operation::Update, new, Some(pending)), now)
                .denied
                .is_none()
        );
        // A label change on a DONE At is fine.
        let mut labelled = old.clone();
        labelled.metadata.labels = Some([("a".to_string(), "b".to_string())].into());
        assert!(
            validate_at(&review(Operation::Update, labelled, Some(old)), now)
                .denied
                .is_none()
        );
    }

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

    #[test]
    fn configurations_point_at_the_endpoint_and_keep_the_operator_namespace_out() {
        let (m, v) = configurations(
            &Endpoint::Url("https://127.0.0.1:9443".into()),
            "opkit-system",
            Some("CA"),
        );
        let mw = &m.webhooks.unwrap()[0];
        assert_eq!(
            mw.client_config.url.as_deref(),
            Some("https://127.0.0.1:9443/mutate-cache-example-com-memcached")
        );
        assert_eq!(mw.failure_policy.as_deref(), Some("Ignore"));
        assert_eq!(mw.side_effects, "None");
        let vw = v.webhooks.unwrap();
        assert_eq!(vw.len(), 2);
        let sel = vw[0]
            .namespace_selector
            .as_ref()
            .unwrap()
            .match_expressions
            .as_ref()
            .unwrap();
        assert_eq!(sel[0].values.as_deref(), Some(&["opkit-system".to_string()][..]));
        let (m, _) = configurations(
            &Endpoint::Service {
                namespace: "opkit-system".into(),
            },
            "opkit-system",
            None,
        );
        let svc = m.webhooks.unwrap()[0].client_config.service.clone().unwrap();
        assert_eq!((svc.name.as_str(), svc.port), (SERVICE, Some(443)));
    }
}
