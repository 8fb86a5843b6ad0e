//! The OLM bundle: committed and fresh, clean under the operator-framework's own validators,
//! and — installed the way OLM installs a ClusterServiceVersion — enough to run every example
//! it advertises with only the permissions it asks for.
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use anyhow::{Context, anyhow, ensure};
use opkit_testenv::{Binaries, Versions, shared, wait_for};
use serde_json::{Value, json};

mod common;
use common::{Running, free_port, jsonpath_is, kubectl, kubectl_stdin, service_account_kubeconfig};

const T: Duration = Duration::from_secs(60);

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn opkit_bundle(root: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_opkit"))
        .arg("bundle")
        .arg("--root")
        .arg(root)
        .args(args)
        .output()
        .expect("opkit runs")
}

/// Runs the operator-framework's validators (built from their Go module) on a bundle.
fn validate(bundle: &Path) -> (bool, String) {
    let bin = Binaries::ensure()
        .expect("the upstream binaries build")
        .path("bundle-validate");
    let k8s = Versions::pinned().kubernetes;
    let minor = k8s
        .trim_start_matches('v')
        .rsplit_once('.')
        .map(|(m, _)| m.to_string())
        .expect("KUBERNETES_VERSION is vX.Y.Z");
    let out = Command::new(&bin)
        .args(["--k8s-version", &minor])
        .arg(bundle)
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", bin.display()));
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// A scratch repository root holding what `opkit bundle` reads.
fn scratch_root(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("opkit-bundle-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    for sub in ["config/manifests", "config/samples"] {
        std::fs::create_dir_all(dir.join(sub)).expect("a scratch directory");
        for f in std::fs::read_dir(root().join(sub)).expect("config/ is readable") {
            let f = f.expect("config/ is readable").path();
            std::fs::copy(&f, dir.join(sub).join(f.file_name().expect("a file name")))
                .expect("copying config/");
        }
    }
    dir
}

#[test]
fn the_committed_bundle_is_fresh() {
    let out = opkit_bundle(&root(), &["--check"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn the_committed_bundle_passes_the_operator_framework_validators() {
    let (ok, report) = validate(&root().join("bundle"));
    println!("{report}");
    assert!(ok, "{report}");
    assert!(report.contains("0 errors, 0 warnings"), "{report}");
}

#[test]
fn the_validators_report_what_a_catalog_would_refuse() {
    let dir = scratch_root("bad");
    // Off-convention channel names: a good-practices warning.
    let out = opkit_bundle(&dir, &["--version", "1.2.3", "--channels", "beta"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (ok, report) = validate(&dir.join("bundle"));
    assert!(!ok, "{report}");
    assert!(report.contains("channel-naming"), "{report}");
    // A maintainer without a valid address: an OperatorHub error.
    let meta = dir.join("config/manifests/metadata.yaml");
    let text = std::fs::read_to_string(&meta).unwrap();
    assert!(text.contains("email: maintainers@opkit.dev"));
    std::fs::write(
        &meta,
        text.replace("email: maintainers@opkit.dev", "email: not-an-address"),
    )
    .unwrap();
    let out = opkit_bundle(&dir, &["--version", "1.2.3"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (ok, report) = validate(&dir.join("bundle"));
    assert!(!ok, "{report}");
    assert!(
        report.contains("ERROR") && report.contains("not-an-address"),
        "{report}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_stale_bundle_and_bad_options_are_reported() {
    let dir = scratch_root("stale");
    let out = opkit_bundle(
        &dir,
        &[
            "--version",
            "0.3.0",
            "--channels",
            "fast,stable",
            "--image",
            "x/opkit:0.3.0",
        ],
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // `--check` regenerates with the bundle's own version, channels and image.
    let out = opkit_bundle(&dir, &["--check"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let samples = dir.join("config/samples/samplecontroller_v1alpha1_foo.yaml");
    let text = std::fs::read_to_string(&samples).unwrap();
    std::fs::write(&samples, text.replace("replicas: 1", "replicas: 2")).unwrap();
    let out = opkit_bundle(&dir, &["--check"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("opkit.clusterserviceversion.yaml"),
        "{err}"
    );
    std::fs::write(dir.join("bundle/manifests/left-over.yaml"), "{}").unwrap();
    let err = String::from_utf8_lossy(&opkit_bundle(&dir, &["--check"]).stderr).to_string();
    assert!(err.contains("left-over.yaml"), "{err}");

    for (args, want) in [
        (vec!["--version", "v1"], "semantic version"),
        (
            vec!["--channels", "fast", "--default-channel", "stable"],
            "not one of --channels",
        ),
    ] {
        let out = opkit_bundle(&dir, &args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(want), "{args:?}: {err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

fn read_yaml(path: &Path) -> anyhow::Result<Value> {
    Ok(serde_yaml::from_str(&std::fs::read_to_string(path)?)?)
}

fn apply_json(v: &Value) -> anyhow::Result<()> {
    let (ok, out) = kubectl_stdin(&["apply", "--server-side", "-f", "-"], v.to_string().as_bytes())?;
    ensure!(ok, "applying {}: {out}", v["kind"]);
    Ok(())
}

/// What OLM does with an AllNamespaces CSV, minus the Pod (kwok runs no container, so the
/// operator runs here, as the CSV's ServiceAccount, with the CSV's arguments): the CRDs, a
/// ServiceAccount, `clusterPermissions` as a ClusterRole, `permissions` as a Role in the
/// install namespace, a serving certificate in the directory OLM mounts, and one webhook
/// configuration per `webhookdefinitions` entry.
#[tokio::test]
async fn the_csv_installed_as_olm_does_runs_its_examples_with_only_its_permissions() {
    shared()
        .in_namespace("olm", |client, ns| async move {
            let bundle = root().join("bundle/manifests");
            let csv = read_yaml(&bundle.join("opkit.clusterserviceversion.yaml"))?;
            for f in std::fs::read_dir(&bundle)? {
                let f = f?.path();
                if read_yaml(&f)?["kind"] == "CustomResourceDefinition" {
                    kubectl(&["apply", "--server-side", "-f", &f.to_string_lossy()])?;
                    kubectl(&["wait", "--for=condition=Established", "-f", &f.to_string_lossy()])?;
                }
            }
            let strategy = &csv["spec"]["install"]["spec"];
            let sa = strategy["deployments"][0]["name"].as_str().context("deployment name")?.to_string();
            apply_json(&json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": sa, "namespace": ns}}))?;
            let cluster_role = format!("{ns}-opkit");
            apply_json(&json!({
                "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                "metadata": {"name": cluster_role},
                "rules": strategy["clusterPermissions"][0]["rules"],
            }))?;
            apply_json(&json!({
                "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                "metadata": {"name": cluster_role},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": cluster_role},
                "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": ns}],
            }))?;
            apply_json(&json!({
                "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                "metadata": {"name": "opkit", "namespace": ns},
                "rules": strategy["permissions"][0]["rules"],
            }))?;
            apply_json(&json!({
                "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                "metadata": {"name": "opkit", "namespace": ns},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "opkit"},
                "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": ns}],
            }))?;

            // The serving certificate, where OLM would mount it; the apiserver reaches the
            // operator on loopback.
            let port = free_port()?;
            let cert = opkit::webhook::self_signed(&["127.0.0.1".to_string()])?;
            let cert_dir = std::env::temp_dir().join(format!("opkit-olm-{ns}"));
            std::fs::create_dir_all(&cert_dir)?;
            std::fs::write(cert_dir.join("tls.crt"), &cert.cert_pem)?;
            std::fs::write(cert_dir.join("tls.key"), &cert.key_pem)?;
            let ca = k8s_openapi::ByteString(cert.ca_pem.clone().into_bytes());
            let defs = csv["spec"]["webhookdefinitions"].as_array().context("webhookdefinitions")?;
            for (kind, config) in [
                ("MutatingAdmissionWebhook", "MutatingWebhookConfiguration"),
                ("ValidatingAdmissionWebhook", "ValidatingWebhookConfiguration"),
            ] {
                let hooks: Vec<Value> = defs
                    .iter()
                    .filter(|d| d["type"] == kind)
                    .map(|d| {
                        let mut h = json!({
                            "name": d["generateName"],
                            "clientConfig": {
                                "url": format!("https://127.0.0.1:{port}{}", d["webhookPath"].as_str().unwrap_or_default()),
                                "caBundle": ca,
                            },
                            "rules": d["rules"],
                            "admissionReviewVersions": d["admissionReviewVersions"],
                            "sideEffects": d["sideEffects"],
                            "failurePolicy": d["failurePolicy"],
                            "matchPolicy": d["matchPolicy"],
                            "timeoutSeconds": d["timeoutSeconds"],
                            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
                        });
                        if kind == "MutatingAdmissionWebhook" {
                            h["reinvocationPolicy"] = d["reinvocationPolicy"].clone();
                        }
                        h
                    })
                    .collect();
                if hooks.is_empty() {
                    // Our operator has no mutating webhook (defaults are schema defaults).
                    ensure!(kind == "MutatingAdmissionWebhook", "the CSV defines no {kind}");
                    continue;
                }
                apply_json(&json!({
                    "apiVersion": "admissionregistration.k8s.io/v1", "kind": config,
                    "metadata": {"name": format!("{ns}-{}", config.to_lowercase())},
                    "webhooks": hooks,
                }))?;
            }

            // OLM points the CRDs of a ConversionWebhook at the operator, with the CA.
            let conversions: Vec<&Value> = defs.iter().filter(|d| d["type"] == "ConversionWebhook").collect();
            ensure!(!conversions.is_empty(), "the CSV defines no ConversionWebhook");
            for d in conversions {
                for crd in d["conversionCRDs"].as_array().context("conversionCRDs")? {
                    let patch = json!({"spec": {"conversion": {
                        "strategy": "Webhook",
                        "webhook": {
                            "conversionReviewVersions": d["admissionReviewVersions"],
                            "clientConfig": {
                                "url": format!("https://127.0.0.1:{port}{}", d["webhookPath"].as_str().unwrap_or_default()),
                                "caBundle": ca,
                                "service": null,
                            },
                        },
                    }}});
                    kubectl(&["patch", "crd", crd.as_str().unwrap_or_default(), "--type", "merge", "-p", &patch.to_string()])?;
                }
            }

            let kubeconfig = service_account_kubeconfig(&client, &ns, &sa).await?;
            // OLM owns the webhook configurations: the operator may not even read them.
            let out = shared()
                .kubectl()
                .env("KUBECONFIG", &kubeconfig)
                .args(["get", "mutatingwebhookconfigurations"])
                .output()?;
            ensure!(!out.status.success(), "the CSV grants access to webhook configurations");

            // The container's arguments from the CSV; only the listen addresses and the
            // certificate directory are this machine's.
            let container = &strategy["deployments"][0]["spec"]["template"]["spec"]["containers"][0];
            let args: Vec<String> = container["args"]
                .as_array()
                .context("args")?
                .iter()
                .filter_map(|a| a.as_str())
                .map(|a| match a.split_once('=') {
                    Some(("--metrics-bind-address" | "--health-probe-bind-address", _)) => format!("{}=0", a.split('=').next().unwrap()),
                    Some(("--webhook-bind-address", _)) => format!("--webhook-bind-address=127.0.0.1:{port}"),
                    Some(("--webhook-cert-dir", _)) => format!("--webhook-cert-dir={}", cert_dir.display()),
                    _ => a.to_string(),
                })
                .collect();
            ensure!(args.iter().any(|a| a == "--manage-webhook-configurations=false"), "{args:?}");
            let log = std::env::temp_dir().join(format!("opkit-olm-{ns}.log"));
            let _op = Running(
                Command::new(env!("CARGO_BIN_EXE_opkit"))
                    .args(&args)
                    .arg("--kubeconfig")
                    .arg(&kubeconfig)
                    .env("POD_NAMESPACE", &ns)
                    .stdout(Stdio::null())
                    .stderr(std::fs::File::create(&log)?)
                    .spawn()?,
            );
            let result = async {
                let examples: Vec<Value> =
                    serde_json::from_str(csv["metadata"]["annotations"]["alm-examples"].as_str().context("alm-examples")?)?;
                // The Deployment Eru's sample restarts is not a CRD example; it comes from config/samples.
                kubectl(&["apply", "-n", &ns, "-f", &root().join("config/samples/apps_v1_deployment_eru.yaml").to_string_lossy()])?;
                for e in &examples {
                    let mut e = e.clone();
                    e["metadata"]["namespace"] = json!(ns);
                    // The operator's webhook server may not answer yet: the At example is refused
                    // until it does (failurePolicy Fail), so apply retries.
                    wait_for(&format!("{} to be admitted", e["metadata"]["name"]), T, || async {
                        apply_json(&e)
                    })
                    .await?;
                }
                jsonpath_is(&["memcached", "memcached-sample"], &ns, "{.status.readyReplicas}", "3").await?;
                jsonpath_is(&["memcached", "example-memcached"], &ns, "{.status.readyReplicas}", "3").await?;
                jsonpath_is(&["at", "example-at"], &ns, "{.status.phase}", "DONE").await?;
                jsonpath_is(&["foo", "example-foo"], &ns, "{.status.availableReplicas}", "1").await?;
                // The v1 CronTab example went through the operator's conversion into v2.
                jsonpath_is(
                    &["crontabs.v2.stable.example.com", "my-new-cron-object"],
                    &ns,
                    "{.spec.schedule.dayOfWeek}",
                    "*/5",
                )
                .await?;
                jsonpath_is(
                    &["eru", "eru-sample"],
                    &ns,
                    "{.status.conditions[?(@.type==\"TargetFound\")].status}",
                    "True",
                )
                .await?;
                // A Memcached without a size is defaulted by its schema, and the webhooks OLM
                // would configure answer: an impossible schedule is refused.
                wait_for("a Memcached without size to be defaulted", T, || async {
                    let (ok, out) = kubectl_stdin(
                        &["apply", "-n", &ns, "-f", "-"],
                        b"apiVersion: cache.example.com/v1\nkind: Memcached\nmetadata:\n  name: no-size\nspec: {}\n",
                    )?;
                    ensure!(ok, "{out}");
                    Ok(())
                })
                .await?;
                jsonpath_is(&["memcached", "no-size"], &ns, "{.spec.size}", "1").await?;
                let (ok, out) = kubectl_stdin(
                    &["apply", "-n", &ns, "-f", "-"],
                    b"apiVersion: mtsre.meitu.com/v1\nkind: Eru\nmetadata:\n  name: never\nspec:\n  deploymentName: web\n  schedule: \"0 0 30 2 *\"\n",
                )?;
                ensure!(!ok && out.contains("denied"), "an impossible schedule was admitted: {out}");
                // The Lease lives in the install namespace, under the CSV's `permissions`.
                let lease = kubectl(&["get", "lease", "opkit-leader", "-n", &ns, "-o", "jsonpath={.spec.holderIdentity}"])?;
                ensure!(!lease.is_empty(), "the operator did not take the Lease");
                anyhow::Ok(())
            }
            .await;
            result.map_err(|e| anyhow!("{e:#}\n--- opkit log ---\n{}", std::fs::read_to_string(&log).unwrap_or_default()))?;
            // OLM's configurations are untouched and the operator made none of its own.
            let names = kubectl(&["get", "mutatingwebhookconfigurations,validatingwebhookconfigurations", "-o", "name"])?;
            ensure!(!names.contains("opkit-"), "the operator wrote webhook configurations: {names}");
            Ok(())
        })
        .await;
}
