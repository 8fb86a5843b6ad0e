//! Telling the apiserver about the webhooks: the two configurations (generated into the
//! manifests, and re-applied at start with the serving CA), and the start-up that makes or
//! loads the certificate and serves.
//!
//! Each webhook's `failurePolicy` is its [`Rule`]'s: `Fail` unless it says otherwise, so its
//! checks hold while the operator is down (those requests are refused meanwhile); `Ignore` for
//! webhooks whose checks also hold further down (schema, controller). Either way the
//! operator's own namespace is left out, so a webhook that cannot answer never blocks fixing
//! the operator itself.
use std::net::SocketAddr;
use std::path::PathBuf;

use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhook, MutatingWebhookConfiguration, RuleWithOperations, ServiceReference, ValidatingWebhook,
    ValidatingWebhookConfiguration, WebhookClientConfig,
};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::api::rbac::v1::PolicyRule;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceConversion, CustomResourceDefinition, ServiceReference as CrdServiceReference,
    WebhookClientConfig as CrdClientConfig, WebhookConversion,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement, ObjectMeta};
use kube::api::{Api, Patch, PatchParams};
use kube::{Client, ResourceExt};
use tokio_util::sync::CancellationToken;

use super::{CertSource, Rule, WebhookError, Webhooks, self_signed, serve, shared};
use crate::rbac::rule;

/// Where the apiserver reaches the webhook server.
#[derive(Clone, Debug)]
pub enum Endpoint {
    /// The in-cluster Service `<project>-webhook-service` in `namespace`.
    Service {
        /// The operator's namespace.
        namespace: String,
    },
    /// A URL base such as `https://127.0.0.1:9443` (operator running outside the cluster).
    Url(String),
}

/// The Service in front of the operator's webhook server.
pub fn service_name(project: &str) -> String {
    format!("{project}-webhook-service")
}

fn mutating_name(project: &str) -> String {
    format!("{project}-mutating-webhook-configuration")
}

fn validating_name(project: &str) -> String {
    format!("{project}-validating-webhook-configuration")
}

fn client_config(
    project: &str,
    endpoint: &Endpoint,
    path: &str,
    ca_bundle: Option<&str>,
) -> WebhookClientConfig {
    WebhookClientConfig {
        ca_bundle: ca_bundle.map(|c| k8s_openapi::ByteString(c.as_bytes().to_vec())),
        service: match endpoint {
            Endpoint::Service { namespace } => Some(ServiceReference {
                name: service_name(project),
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

fn rules(r: &Rule) -> Option<Vec<RuleWithOperations>> {
    let s = |v: &[&str]| Some(v.iter().map(|x| x.to_string()).collect());
    Some(vec![RuleWithOperations {
        api_groups: s(&[r.group]),
        api_versions: s(r.versions),
        operations: s(r.operations),
        resources: s(&[r.resource]),
        scope: Some(r.scope.as_str().into()),
    }])
}

/// Keeps the operator's own namespace out, so a broken webhook can never block fixing it.
/// (The apiserver applies it to namespaced objects and Namespaces only; other cluster-scoped
/// objects are always sent.)
/// A webhook limited to some namespaces ([`Webhooks::in_namespaces`]) gets those, too.
fn namespace_selector(own_namespace: &str, only: Option<&Vec<String>>) -> Option<LabelSelector> {
    let name = "kubernetes.io/metadata.name";
    let mut match_expressions = vec![LabelSelectorRequirement {
        key: name.into(),
        operator: "NotIn".into(),
        values: Some(vec![own_namespace.into()]),
    }];
    if let Some(only) = only {
        match_expressions.push(LabelSelectorRequirement {
            key: name.into(),
            operator: "In".into(),
            values: Some(only.clone()),
        });
    }
    Some(LabelSelector {
        match_expressions: Some(match_expressions),
        ..Default::default()
    })
}

/// The two webhook configurations of `project`, pointing at `endpoint`, trusting `ca_bundle`
/// (PEM) if given.
pub fn configurations(
    project: &str,
    webhooks: &Webhooks,
    endpoint: &Endpoint,
    own_namespace: &str,
    ca_bundle: Option<&str>,
) -> (MutatingWebhookConfiguration, ValidatingWebhookConfiguration) {
    let meta = |name: String| ObjectMeta {
        name: Some(name),
        ..Default::default()
    };
    let versions = vec!["v1".to_string()];
    let mutating = MutatingWebhookConfiguration {
        metadata: meta(mutating_name(project)),
        webhooks: Some(
            webhooks
                .mutating
                .iter()
                .map(|r| MutatingWebhook {
                    name: r.name.into(),
                    client_config: client_config(project, endpoint, r.path, ca_bundle),
                    rules: rules(r),
                    failure_policy: Some(r.failure_policy.as_str().into()),
                    side_effects: "None".into(),
                    admission_review_versions: versions.clone(),
                    timeout_seconds: Some(5),
                    match_policy: Some("Equivalent".into()),
                    namespace_selector: namespace_selector(own_namespace, webhooks.scoped.get(r.path)),
                    reinvocation_policy: Some("Never".into()),
                    ..Default::default()
                })
                .collect(),
        ),
    };
    let validating = ValidatingWebhookConfiguration {
        metadata: meta(validating_name(project)),
        webhooks: Some(
            webhooks
                .validating
                .iter()
                .map(|r| ValidatingWebhook {
                    name: r.name.into(),
                    client_config: client_config(project, endpoint, r.path, ca_bundle),
                    rules: rules(r),
                    failure_policy: Some(r.failure_policy.as_str().into()),
                    side_effects: "None".into(),
                    admission_review_versions: versions.clone(),
                    timeout_seconds: Some(5),
                    match_policy: Some("Equivalent".into()),
                    namespace_selector: namespace_selector(own_namespace, webhooks.scoped.get(r.path)),
                    ..Default::default()
                })
                .collect(),
        ),
    };
    (mutating, validating)
}

/// The `conversion` of a CRD converted by `project`'s webhook server at `endpoint`, trusting
/// `ca_bundle` (PEM) if given.
pub fn crd_conversion(
    project: &str,
    endpoint: &Endpoint,
    ca_bundle: Option<&str>,
) -> CustomResourceConversion {
    let c = client_config(project, endpoint, super::CONVERT_PATH, ca_bundle);
    CustomResourceConversion {
        strategy: "Webhook".into(),
        webhook: Some(WebhookConversion {
            conversion_review_versions: vec!["v1".into()],
            client_config: Some(CrdClientConfig {
                ca_bundle: c.ca_bundle,
                service: c.service.map(|s| CrdServiceReference {
                    name: s.name,
                    namespace: s.namespace,
                    path: s.path,
                    port: s.port,
                }),
                url: c.url,
            }),
        }),
    }
}

/// `crds` with the conversion stanza on each one `webhooks` converts.
pub fn with_conversions(
    mut crds: Vec<CustomResourceDefinition>,
    project: &str,
    webhooks: &Webhooks,
    endpoint: &Endpoint,
) -> Vec<CustomResourceDefinition> {
    let converted = webhooks.conversion_crds();
    for crd in &mut crds {
        if converted.contains(&crd.name_any()) {
            crd.spec.conversion = Some(crd_conversion(project, endpoint, None));
        }
    }
    crds
}

/// What the operator needs to keep the configurations' `caBundle` (and endpoint) current,
/// and those of the CRDs it converts.
pub fn rbac_rules(project: &str, webhooks: &Webhooks) -> Vec<PolicyRule> {
    let mut rules: Vec<PolicyRule> = [
        ("mutatingwebhookconfigurations", mutating_name(project)),
        ("validatingwebhookconfigurations", validating_name(project)),
    ]
    .map(|(resource, name)| PolicyRule {
        resource_names: Some(vec![name]),
        // Applied (server-side), never read.
        ..rule(&["admissionregistration.k8s.io"], &[resource], &["patch"])
    })
    .to_vec();
    let converted = webhooks.conversion_crds();
    if !converted.is_empty() {
        rules.push(PolicyRule {
            resource_names: Some(converted),
            ..rule(
                &["apiextensions.k8s.io"],
                &["customresourcedefinitions"],
                &["patch"],
            )
        });
    }
    rules
}

/// What the operator needs, in its own namespace, to share one webhook certificate among its
/// replicas through the Secret `<project>-webhook-server-cert` (create cannot be limited to a
/// name; reading and rotating it are).
pub fn secret_rules(project: &str) -> Vec<PolicyRule> {
    let mut rules = vec![PolicyRule {
        resource_names: Some(vec![shared::secret_name(project)]),
        ..rule(&[""], &["secrets"], &["get", "update"])
    }];
    rules.extend(key_secret_rules(project));
    rules
}

/// What the operator needs, in its own namespace, to share the key that signs conversion
/// annotations among its replicas (the Secret `<project>-conversion-key`, made once, then
/// only read), also when something else provides the webhook certificate (OLM).
pub fn key_secret_rules(project: &str) -> Vec<PolicyRule> {
    vec![
        PolicyRule {
            resource_names: Some(vec![shared::key_secret_name(project)]),
            ..rule(&[""], &["secrets"], &["get"])
        },
        rule(&[""], &["secrets"], &["create"]),
    ]
}

/// How the operator serves its webhooks.
#[derive(Clone, Debug)]
pub struct WebhookOptions {
    /// Prefix of the configuration and Service names (`<project>-webhook-service`).
    pub project: &'static str,
    /// Where to listen (HTTPS).
    pub bind: SocketAddr,
    /// `tls.crt`, `tls.key` and `ca.crt` (a cert-manager Secret mount); `None` makes a
    /// self-signed certificate at start.
    pub cert_dir: Option<PathBuf>,
    /// Base URL the apiserver uses when the operator runs outside the cluster; `None`: the
    /// Service in `namespace`.
    pub url: Option<String>,
    /// The operator's namespace (kept out of the webhooks' reach).
    pub namespace: String,
    /// Whether the operator writes the webhook configurations itself; `false` when something
    /// else owns them (OLM, which also mounts the certificate, or a kustomize overlay).
    pub configure: bool,
    /// Whether to offer HTTP/2 as well as HTTP/1.1 (see [`super::serve`]).
    pub http2: bool,
}

/// Makes or loads the serving certificate, serves `webhooks` until `shutdown` (and its grace
/// period, [`super::limits::SHUTDOWN_GRACE`]), and points the webhook configurations at this
/// server with its CA. Await the returned server before the process exits, so the grace
/// period is served.
pub async fn start(
    client: &Client,
    webhooks: &Webhooks,
    opts: &WebhookOptions,
    shutdown: CancellationToken,
) -> Result<tokio::task::JoinHandle<()>, WebhookError> {
    let endpoint = match &opts.url {
        Some(u) => Endpoint::Url(u.clone()),
        None => Endpoint::Service {
            namespace: opts.namespace.clone(),
        },
    };
    let hosts = match &endpoint {
        Endpoint::Url(u) => vec![
            u.trim_start_matches("https://")
                .split(['/', ':'])
                .next()
                .unwrap_or_default()
                .to_string(),
        ],
        Endpoint::Service { namespace } => {
            let svc = service_name(opts.project);
            vec![
                format!("{svc}.{namespace}.svc"),
                format!("{svc}.{namespace}.svc.cluster.local"),
            ]
        }
    };
    let (certs, source) = match &opts.cert_dir {
        Some(dir) => (CertSource::Dir(dir.clone()), Source::File(dir.join("ca.crt"))),
        None => {
            let secrets: Api<Secret> = Api::namespaced(client.clone(), &opts.namespace);
            let name = shared::secret_name(opts.project);
            // A transient failure (a 500, RBAC not effective yet) is retried: a replica that
            // served a CA of its own would not be trusted once another publishes the shared one.
            let (initial, own_ca) = match ensure_patiently(&secrets, &name, &hosts).await {
                Ok(sh) => (sh.serving, None),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read or make the shared webhook certificate yet; serving one of this process until it can (published only while no shared Secret exists)");
                    let cert = self_signed(&hosts).map_err(|e| WebhookError::Certificate(e.to_string()))?;
                    ((cert.cert_pem, cert.key_pem), Some(cert.ca_pem))
                }
            };
            let (tx, rx) = tokio::sync::watch::channel(initial);
            let source = Source::Secret {
                secrets: Box::new(secrets),
                name,
                hosts: hosts.clone(),
                tx,
                own_ca,
                failing: None,
            };
            (CertSource::Watch(rx), source)
        }
    };
    let mut served = webhooks.clone().with_client(client.clone());
    if !webhooks.conversions.is_empty() {
        served = with_signing_key(served, client, opts, shutdown.clone()).await;
    }
    read_storage_versions(client, webhooks).await;
    let server = serve(&served, opts.bind, certs, opts.http2, shutdown.clone()).await?;
    let configure = opts.configure;
    let mut source = source;
    let mut bundle = source.bundle().await;
    if configure && bundle.is_none() && matches!(source, Source::Secret { .. }) {
        // Applying without a CA would take the shared one out of the configurations.
        tracing::warn!(
            "the webhook configurations are left as they are until the shared certificate can be read"
        );
    } else if configure {
        apply(
            client,
            opts.project,
            webhooks,
            &endpoint,
            &opts.namespace,
            bundle.as_deref(),
        )
        .await?;
        tracing::info!(?endpoint, "webhook configurations point at this server");
    } else {
        tracing::info!("serving webhooks; their configurations are managed elsewhere");
    }
    // Keep serving the current certificate and the configurations trusting its CA: a renewed
    // cert-manager Secret, or a rotation of the shared one by any replica.
    let (client, webhooks, opts) = (client.clone(), webhooks.clone(), opts.clone());
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(source.every()) => {}
            }
            read_storage_versions(&client, &webhooks).await;
            let now = source.bundle().await;
            if now.is_some() && now != bundle && configure {
                match apply(
                    &client,
                    opts.project,
                    &webhooks,
                    &endpoint,
                    &opts.namespace,
                    now.as_deref(),
                )
                .await
                {
                    Ok(()) => tracing::info!("webhook configurations trust the renewed CA"),
                    Err(e) => {
                        tracing::warn!(error = %e, "updating the webhook CA bundle failed; retrying");
                        continue;
                    }
                }
            }
            bundle = now;
        }
    });
    Ok(server)
}

/// Tells each conversion which version its CRD stores (a conversion to it is a write); kept
/// as it was when the CRD cannot be read.
async fn read_storage_versions(client: &Client, webhooks: &Webhooks) {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for c in &webhooks.conversions {
        match crds.get_opt(&c.crd_name()).await {
            Ok(Some(crd)) => {
                if let Some(v) = crd.spec.versions.iter().find(|v| v.storage) {
                    c.set_storage(&v.name);
                }
            }
            Ok(None) => {}
            Err(e) => tracing::debug!(crd = %c.crd_name(), error = %e, "reading the storage version"),
        }
    }
}

/// `webhooks` with the conversion signing key the replicas share, read (or made) from its
/// Secret. A replica that cannot read it yet keeps trying, and until then fails conversions
/// that need it, naming the cause: content signed with a key of its own would be dropped by
/// every other replica. A local run (`--webhook-url`) whose Secret cannot be used at all (its
/// namespace missing, no right to it) signs with a key of its own, as the only replica.
async fn with_signing_key(
    webhooks: Webhooks,
    client: &Client,
    opts: &WebhookOptions,
    shutdown: CancellationToken,
) -> Webhooks {
    use crate::conversion::SigningKey;
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &opts.namespace);
    let name = shared::key_secret_name(opts.project);
    let first = patiently(
        || shared::ensure_key(&secrets, &name),
        "the conversion signing key",
    )
    .await;
    let error = match first {
        Ok(key) => {
            let known = std::sync::OnceLock::from(SigningKey::new(&key));
            return webhooks.with_conversion_key(std::sync::Arc::new(known), String::new());
        }
        Err(e) => e,
    };
    if opts.url.is_some() {
        tracing::warn!(error = %error, "cannot read or make the conversion signing key; this local run signs with a key of its own, so what its conversions keep is not restored after a restart");
        return webhooks;
    }
    tracing::warn!(error = %error, "cannot read or make the conversion signing key; conversions that keep or restore content fail until it can");
    let key = std::sync::Arc::new(std::sync::OnceLock::new());
    let why = format!(
        "the operator cannot read the conversion signing key (Secret {}/{name}) yet: {error}",
        opts.namespace
    );
    let filled = key.clone();
    tokio::spawn(async move {
        let mut pause = std::time::Duration::from_secs(2);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(pause) => {}
            }
            match shared::ensure_key(&secrets, &name).await {
                Ok(k) => {
                    let _ = filled.set(SigningKey::new(&k));
                    tracing::info!(secret = %name, "read the conversion signing key");
                    return;
                }
                Err(e) => {
                    tracing::warn!(error = %e, ?pause, "reading the conversion signing key failed; retrying")
                }
            }
            pause = (pause * 2).min(std::time::Duration::from_secs(30));
        }
    });
    webhooks.with_conversion_key(key, why)
}

/// [`shared::ensure`], a transient failure retried with backoff for about 20 s.
async fn ensure_patiently(
    secrets: &Api<Secret>,
    name: &str,
    hosts: &[String],
) -> Result<shared::Shared, String> {
    patiently(
        || shared::ensure(secrets, name, hosts),
        "the shared webhook certificate",
    )
    .await
}

/// `attempt` until it succeeds, a transient failure retried with backoff for about 20 s.
async fn patiently<T, F>(mut attempt: impl FnMut() -> F, what: &str) -> Result<T, String>
where
    F: std::future::Future<Output = Result<T, shared::EnsureError>>,
{
    let mut pause = std::time::Duration::from_millis(500);
    let give_up = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        match attempt().await {
            Ok(sh) => return Ok(sh),
            // A missing namespace or a refusal will not change by waiting (a local run, a
            // lone replica without the right): no retries then.
            Err(e) if e.transient && tokio::time::Instant::now() + pause < give_up => {
                tracing::warn!(error = %e, ?pause, "reading {what} failed; retrying");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(std::time::Duration::from_secs(5));
            }
            Err(e) => return Err(e.message),
        }
    }
}

/// Where the CA bundle (and, for the shared Secret, the serving certificate) comes from.
enum Source {
    /// `ca.crt` next to the mounted certificate.
    File(PathBuf),
    /// The shared Secret.
    Secret {
        secrets: Box<Api<Secret>>,
        name: String,
        hosts: Vec<String>,
        tx: tokio::sync::watch::Sender<(String, String)>,
        /// The CA of the certificate this process made because the Secret could not be used
        /// at start; `None` once it serves the shared one.
        own_ca: Option<String>,
        /// The last failure logged: the same one again (a local run whose Secret namespace
        /// does not exist fails every time) is logged at debug level only.
        failing: Option<String>,
    },
}

impl Source {
    fn every(&self) -> std::time::Duration {
        match self {
            Source::Secret { own_ca: None, .. } => shared::RELOAD_EVERY,
            _ => std::time::Duration::from_secs(5),
        }
    }

    /// The current CA bundle (`None`: cannot be read now, leave the configurations as they
    /// are); for the Secret, also hands the certificate to serve to the server. A process
    /// serving a certificate of its own switches to the shared one as soon as it can be used,
    /// and publishes its own CA only while no shared Secret exists (a single replica without
    /// the right to make one).
    async fn bundle(&mut self) -> Option<String> {
        match self {
            Source::File(path) => std::fs::read_to_string(path).ok(),
            Source::Secret {
                secrets,
                name,
                hosts,
                tx,
                own_ca,
                failing,
            } => match shared::ensure(secrets, name, hosts).await {
                Ok(sh) => {
                    if failing.take().is_some() {
                        tracing::info!("the shared webhook certificate can be read again");
                    }
                    tx.send_if_modified(|s| {
                        let changed = *s != sh.serving;
                        *s = sh.serving.clone();
                        changed
                    });
                    if own_ca.take().is_some() {
                        tracing::info!("serving the shared webhook certificate");
                    }
                    Some(sh.ca_bundle)
                }
                Err(e) => {
                    let message = e.to_string();
                    if failing.as_deref() == Some(message.as_str()) {
                        tracing::debug!(error = %e, "reading the shared webhook certificate failed again");
                    } else {
                        tracing::warn!(error = %e, "reading the shared webhook certificate failed; retrying quietly while it fails the same way");
                        *failing = Some(message);
                    }
                    match (own_ca.as_ref(), secrets.get_opt(name).await) {
                        (Some(ca), Ok(None)) => Some(ca.clone()),
                        _ => None,
                    }
                }
            },
        }
    }
}

/// Applies both configurations, pointing at `endpoint` and trusting `ca`.
async fn apply(
    client: &Client,
    project: &'static str,
    webhooks: &Webhooks,
    endpoint: &Endpoint,
    namespace: &str,
    ca: Option<&str>,
) -> Result<(), WebhookError> {
    let (m, v) = configurations(project, webhooks, endpoint, namespace, ca);
    let pp = PatchParams::apply(&format!("{project}-webhooks")).force();
    let configure = |what: &'static str| move |source| WebhookError::Configure { what, source };
    let mutating: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    mutating
        .patch(&m.name_any(), &pp, &Patch::Apply(&m))
        .await
        .map_err(configure("mutating"))?;
    let validating: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    validating
        .patch(&v.name_any(), &pp, &Patch::Apply(&v))
        .await
        .map_err(configure("validating"))?;
    // A merge patch, not an apply: `make install` and `make deploy` apply these CRDs
    // server-side, and must not meet a conflict over the fields kept current here.
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let mut conversion = serde_json::to_value(crd_conversion(project, endpoint, ca))
        .map_err(|e| WebhookError::Certificate(format!("encoding the CRD conversion: {e}")))?;
    // The endpoint not used is cleared: a CRD may have only one of `url` and `service`.
    if let Some(c) = conversion
        .pointer_mut("/webhook/clientConfig")
        .and_then(|c| c.as_object_mut())
    {
        for key in ["url", "service"] {
            c.entry(key).or_insert(serde_json::Value::Null);
        }
    }
    for name in webhooks.conversion_crds() {
        let patch = serde_json::json!({"spec": {"conversion": conversion}});
        match crds
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => {}
            // Not installed here (this replica runs other controllers): nothing to convert.
            Err(kube::Error::Api(e)) if e.code == 404 => {
                tracing::warn!(crd = %name, "not installed: its conversion is not configured");
            }
            Err(e) => return Err(configure("conversion")(e)),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::webhook::{FailurePolicy, RuleScope, Verdict};
    use kube::core::DynamicObject;

    fn hooks() -> Webhooks {
        let rule = |name, path, failure_policy, scope| Rule {
            name,
            path,
            group: "example.com",
            versions: &["v1"],
            resource: "things",
            operations: &["CREATE"],
            failure_policy,
            scope,
        };
        Webhooks::new()
            .mutating::<DynamicObject, _, _>(
                rule(
                    "mthing.example.com",
                    "/mutate",
                    FailurePolicy::default(),
                    RuleScope::default(),
                ),
                |_| async { Verdict::allow() },
            )
            .validating::<DynamicObject, _, _>(
                rule(
                    "vthing.example.com",
                    "/validate",
                    FailurePolicy::Ignore,
                    RuleScope::Cluster,
                ),
                |_| async { Verdict::allow() },
            )
    }

    #[test]
    fn each_webhook_gets_its_rules_failure_policy_and_scope() {
        let (m, v) = configurations(
            "opkit",
            &hooks(),
            &Endpoint::Url("https://127.0.0.1:9443".into()),
            "opkit-system",
            None,
        );
        let (mw, vw) = (&m.webhooks.unwrap()[0], &v.webhooks.unwrap()[0]);
        // The defaults: Kubebuilder's Fail, a namespaced kind.
        assert_eq!(mw.failure_policy.as_deref(), Some("Fail"));
        assert_eq!(mw.rules.as_ref().unwrap()[0].scope.as_deref(), Some("Namespaced"));
        assert_eq!(vw.failure_policy.as_deref(), Some("Ignore"));
        assert_eq!(vw.rules.as_ref().unwrap()[0].scope.as_deref(), Some("Cluster"));
    }

    #[test]
    fn configurations_point_at_the_endpoint_and_keep_the_operator_namespace_out() {
        let (m, v) = configurations(
            "opkit",
            &hooks(),
            &Endpoint::Url("https://127.0.0.1:9443".into()),
            "opkit-system",
            Some("CA"),
        );
        let mw = &m.webhooks.unwrap()[0];
        assert_eq!(
            mw.client_config.url.as_deref(),
            Some("https://127.0.0.1:9443/mutate")
        );
        assert_eq!(mw.side_effects, "None");
        let vw = v.webhooks.unwrap();
        assert_eq!(vw.len(), 1);
        let sel = vw[0]
            .namespace_selector
            .as_ref()
            .unwrap()
            .match_expressions
            .as_ref()
            .unwrap();
        assert_eq!(sel[0].values.as_deref(), Some(&["opkit-system".to_string()][..]));
        let (m, _) = configurations(
            "opkit",
            &hooks(),
            &Endpoint::Service {
                namespace: "opkit-system".into(),
            },
            "opkit-system",
            None,
        );
        let svc = m.webhooks.unwrap()[0].client_config.service.clone().unwrap();
        assert_eq!(
            (svc.name.as_str(), svc.port),
            ("opkit-webhook-service", Some(443))
        );
        assert_eq!(
            rbac_rules("opkit", &hooks())[0].resource_names.as_deref(),
            Some(&["opkit-mutating-webhook-configuration".to_string()][..])
        );
    }
}
