//! The operator as users deploy it, on the real node, as seed 001 does: `make docker-build
//! docker-push` to the control plane's registry, `make deploy` from it. It runs as a Pod under the generated ServiceAccount in the
//! `restricted` namespace, its probes pass, the apiserver reaches its webhook through the
//! Service, the metrics Service answers over HTTPS to a token allowed to read it (401 without
//! one, 403 without the role), and `make undeploy` removes it all.
//! Needs `OPKIT_TESTENV_REAL_NODE=1` (as `make test` sets).
use std::path::PathBuf;

use serde::Deserialize;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, anyhow, ensure};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Namespace, Pod, Service};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Api;
use kube::api::{ListParams, ObjectMeta, PostParams};
use opkit_testenv::{http_get, https_get, shared_real_node, wait_for};

mod common;
use common::{jsonpath, jsonpath_is, kubectl, kubectl_stdin};

const T: Duration = Duration::from_secs(120);
/// The image's name in the control plane's registry (`<registry>/opkit:in-cluster-test`).
const IMG_NAME: &str = "opkit:in-cluster-test";
const NS: &str = "opkit-system";

fn repo() -> PathBuf {
    PathBuf::from(format!("{}/../..", env!("CARGO_MANIFEST_DIR")))
}

/// `make <args>` in the repository against the test cluster; fails with its output.
fn make(kubeconfig: &std::path::Path, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new("make")
        .arg("-C")
        .arg(repo())
        .args(args)
        .env("KUBECONFIG", kubeconfig)
        .output()?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(out.status.success(), "make {}:\n{text}", args.join(" "));
    Ok(text)
}

#[tokio::test]
async fn docker_build_load_and_make_deploy_run_the_operator_in_the_cluster() {
    let Some(cluster) = shared_real_node() else {
        return;
    };
    let kubeconfig = cluster.kubeconfig().to_path_buf();
    let registry = cluster.registry().expect("the real node has a registry");
    let img = format!("{registry}/{IMG_NAME}");
    cluster
        .in_namespace("in-cluster", |client, ns| async move {
            // The debug binary the tests already built (a release build would be a second
            // dependency tree; `make docker-build` builds release by default).
            let built = make(
                &kubeconfig,
                &["docker-build", &format!("IMG={img}"), "PROFILE=dev"],
            )?;
            println!(
                "{}",
                built
                    .lines()
                    .filter(|l| l.starts_with(">>"))
                    .collect::<Vec<_>>()
                    .join("\n")
            );
            // Pushed to the registry, which the node has never pulled it from: the Pod pulls it.
            make(&kubeconfig, &["docker-push", &format!("IMG={img}")])?;
            let images = kubectl(&[
                "get",
                "node",
                opkit_testenv::node::NODE_NAME,
                "-o",
                "jsonpath={.status.images[*].names}",
            ])?;
            ensure!(!images.contains(&img), "{img} is already on the node: {images}");

            // The operator's namespace puts its Pods on the real node; `make deploy` adds the
            // restricted Pod Security label to it.
            let namespaces: Api<Namespace> = Api::all(client.clone());
            let operator_ns = Namespace {
                metadata: ObjectMeta {
                    name: Some(NS.into()),
                    annotations: Some(opkit_testenv::node::namespace_annotations()),
                    ..Default::default()
                },
                ..Default::default()
            };
            namespaces.create(&PostParams::default(), &operator_ns).await?;
            make(&kubeconfig, &["deploy", &format!("IMG={img}")])?;

            // The per-kind viewer/editor roles are aggregated into Kubernetes' `view` and `edit`
            // (by the controller-manager): a viewer of the namespace reads Memcacheds and may
            // not create them, an editor may.
            for (role, who) in [("view", "viewer"), ("edit", "editor")] {
                kubectl(&[
                    "create",
                    "rolebinding",
                    who,
                    "-n",
                    &ns,
                    &format!("--clusterrole={role}"),
                    &format!("--user={who}"),
                ])?;
            }
            wait_for(
                "the kinds' roles to be aggregated into view and edit",
                T,
                || async {
                    let can = |verb: &str, who: &str| -> anyhow::Result<String> {
                        // `can-i` exits 1 for "no": read the answer, not the status.
                        let out = opkit_testenv::shared()
                            .kubectl()
                            .args(["auth", "can-i", verb, "memcacheds.cache.example.com", "-n", &ns])
                            .arg(format!("--as={who}"))
                            .output()?;
                        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
                    };
                    let answers = [
                        can("list", "viewer")?,
                        can("create", "viewer")?,
                        can("create", "editor")?,
                    ];
                    ensure!(
                        answers == ["yes", "no", "yes"],
                        "list/create as viewer, create as editor: {answers:?}"
                    );
                    Ok(())
                },
            )
            .await?;

            // Available means the kubelet's readiness probe on /readyz passed in the container.
            let deploys: Api<Deployment> = Api::namespaced(client.clone(), NS);
            let waited = wait_for("the manager Deployment to be available", T, || async {
                let d = deploys.get("opkit-controller-manager").await?;
                match d.status.as_ref().and_then(|s| s.available_replicas) {
                    Some(1) => Ok(()),
                    other => Err(anyhow!("available {other:?}")),
                }
            })
            .await;
            if let Err(e) = waited {
                let logs = kubectl(&["logs", "-n", NS, "deploy/opkit-controller-manager", "--tail=30"])
                    .unwrap_or_default();
                let pods = kubectl(&["describe", "pods", "-n", NS]).unwrap_or_default();
                return Err(e.context(format!("{pods}\n--- manager log ---\n{logs}")));
            }
            let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
            let pod = pods
                .list(&ListParams::default().labels("control-plane=controller-manager"))
                .await?
                .items
                .into_iter()
                .next()
                .context("no manager Pod")?;
            let spec = pod.spec.as_ref().context("no spec")?;
            ensure!(
                spec.node_name.as_deref() == Some(opkit_testenv::node::NODE_NAME),
                "the manager runs on {:?}",
                spec.node_name
            );
            ensure!(spec.service_account_name.as_deref() == Some("opkit-controller-manager"));
            let status = pod.status.as_ref().context("no status")?;
            let container = status
                .container_statuses
                .as_ref()
                .and_then(|c| c.first())
                .context("no container status")?;
            ensure!(
                container.ready && container.restart_count == 0,
                "manager container: ready {}, restarts {}",
                container.ready,
                container.restart_count
            );
            ensure!(
                container.image.ends_with(&img),
                "manager runs image {}",
                container.image
            );
            let label = kubectl(&[
                "get",
                "namespace",
                NS,
                "-o",
                "jsonpath={.metadata.labels.pod-security\\.kubernetes\\.io/enforce}",
            ])?;
            ensure!(label == "restricted", "{NS} enforces {label:?}");
            // In-cluster configuration: the operator talks to the apiserver through the
            // `kubernetes` Service with the mounted token (it logs JSON).
            let log = kubectl(&["logs", "-n", NS, "deploy/opkit-controller-manager"])?;
            ensure!(
                log.lines().any(|l| l.starts_with('{')),
                "no JSON log lines:\n{log}"
            );

            // The webhooks, reached by the apiserver through opkit-webhook-service: an At
            // scheduled in 2010 is refused with the At webhook's message (until the server
            // answers, the apiserver reports failing to call it).
            let ancient = r#"{"apiVersion":"cnat.programming-kubernetes.info/v1alpha1","kind":"At",
                "metadata":{"name":"ancient"},"spec":{"schedule":"2010-01-01T00:00:00Z","command":"echo"}}"#;
            wait_for("the At webhook to refuse an ancient At", T, || async {
                let (ok, out) = kubectl_stdin(
                    &["create", "--dry-run=server", "-n", &ns, "-f", "-"],
                    ancient.as_bytes(),
                )?;
                ensure!(!ok && out.contains("more than 10 years in the past"), "{out}");
                Ok(())
            })
            .await?;
            // The conversion webhook, through the same Service: the documentation's v1
            // CronTab is stored as v2.
            let samples = concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../../config/samples/stable_v1_crontab.yaml"
            );
            wait_for("the v1 CronTab to be converted", T, || async {
                let (ok, out) = kubectl_stdin(&["apply", "-n", &ns, "-f", "-"], &std::fs::read(samples)?)?;
                ensure!(ok, "{out}");
                Ok(())
            })
            .await?;
            let v2 = jsonpath(
                &["crontabs.v2.stable.example.com", "my-new-cron-object"],
                &ns,
                "{.spec.schedule.dayOfWeek}",
            )?;
            ensure!(v2 == "*/5", "dayOfWeek {v2:?}");
            // A Memcached without a size gets the schema's default...
            let no_size = r#"{"apiVersion":"cache.example.com/v1","kind":"Memcached",
                "metadata":{"name":"defaulted"},"spec":{}}"#;
            let (ok, out) = kubectl_stdin(&["create", "-n", &ns, "-f", "-"], no_size.as_bytes())?;
            ensure!(ok, "{out}");
            let size = jsonpath(&["memcached", "defaulted"], &ns, "{.spec.size}")?;
            ensure!(size == "1", "size {size:?}");
            // ...and the operator in the cluster reconciles it into a running memcached.
            jsonpath_is(
                &["memcached", "defaulted"],
                &ns,
                "{.status.conditions[?(@.type==\"Available\")].status}",
                "True",
            )
            .await?;

            // The metrics Service, from this host through kube-proxy: HTTPS, and only for a
            // token whose user is bound to the metrics-reader ClusterRole.
            let services: Api<Service> = Api::namespaced(client.clone(), NS);
            let svc = services.get("opkit-controller-manager-metrics-service").await?;
            let ip = svc.spec.and_then(|s| s.cluster_ip).context("no ClusterIP")?;
            let addr: std::net::SocketAddr = format!("{ip}:8443").parse()?;
            for sa in ["scraper", "stranger"] {
                kubectl(&["create", "serviceaccount", sa, "-n", &ns])?;
            }
            kubectl(&[
                "create",
                "clusterrolebinding",
                &format!("{ns}-scraper"),
                "--clusterrole=opkit-metrics-reader",
                &format!("--serviceaccount={ns}:scraper"),
            ])?;
            let scraper = common::service_account_token(&client, &ns, "scraper").await?;
            let stranger = common::service_account_token(&client, &ns, "stranger").await?;
            let metrics = wait_for("the metrics Service to answer the scraper", T, || async {
                match https_get(addr, "/metrics", Some(&scraper)).await {
                    Ok((200, body)) if body.contains("opkit_reconcile_total") => Ok(body),
                    Ok((code, body)) => Err(anyhow!("{code}: {}", &body[..body.len().min(200)])),
                    Err(e) => Err(anyhow!("{e}")),
                }
            })
            .await?;
            ensure!(
                metrics.contains("controller=\"memcached\""),
                "no memcached series:\n{metrics}"
            );
            let (code, body) = https_get(addr, "/metrics", None).await?;
            ensure!(code == 401, "without a token: {code} {body}");
            let (code, body) = https_get(addr, "/metrics", Some("not-a-token")).await?;
            ensure!(code == 401, "with a made-up token: {code} {body}");
            let (code, body) = https_get(addr, "/metrics", Some(&stranger)).await?;
            ensure!(
                code == 403 && body.contains("may not get /metrics"),
                "without the role: {code} {body}"
            );
            ensure!(
                http_get(addr, "/metrics").await.map(|(c, _)| c).unwrap_or(0) != 200,
                "plain HTTP answered"
            );
            kubectl(&["delete", "clusterrolebinding", &format!("{ns}-scraper")])?;

            make(&kubeconfig, &["undeploy"])?;
            let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
            wait_for("make undeploy to remove everything", T, || async {
                let left: Vec<String> = [
                    namespaces.get_opt(NS).await?.map(|_| format!("namespace {NS}")),
                    crds.get_opt("memcacheds.cache.example.com")
                        .await?
                        .map(|_| "the Memcached CRD".to_string()),
                    kubectl(&[
                        "get",
                        "mutatingwebhookconfigurations,validatingwebhookconfigurations",
                        "-o",
                        "name",
                    ])
                    .ok()
                    .filter(|o| o.contains("opkit")),
                    kubectl(&["get", "clusterroles,clusterrolebindings", "-o", "name"])
                        .ok()
                        .filter(|o| o.contains("opkit")),
                ]
                .into_iter()
                .flatten()
                .collect();
                if left.is_empty() {
                    Ok(())
                } else {
                    Err(anyhow!("left: {left:?}"))
                }
            })
            .await?;
            helm_install_upgrade_rollback_uninstall(&client, &kubeconfig, &ns, &img).await
        })
        .await;
}

const HELM_NS: &str = "opkit-helm";

/// `helm <args>` on the chart's release against the test cluster; fails with its output.
fn helm(kubeconfig: &std::path::Path, args: &[&str]) -> anyhow::Result<String> {
    let bin = opkit_testenv::Binaries::ensure()?;
    let out = Command::new(bin.path("helm"))
        .args(args)
        .args(["--namespace", HELM_NS])
        .env("KUBECONFIG", kubeconfig)
        .env("HELM_CACHE_HOME", std::env::temp_dir().join("opkit-helm-cache"))
        .env("HELM_CONFIG_HOME", std::env::temp_dir().join("opkit-helm-config"))
        .output()?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(out.status.success(), "helm {}:\n{text}", args.join(" "));
    Ok(text)
}

/// The same image (`img`, in the registry) through the chart: `helm install` runs the
/// operator (webhooks answer, a Memcached converges); `helm upgrade` to another image, loaded
/// into the node as `make testenv-load` does, and 2 replicas while Ats are created every
/// 100 ms, none refused; `helm rollback` to 1 replica of the first image; `helm uninstall`
/// leaves only the CRDs (kept by the chart's default).
async fn helm_install_upgrade_rollback_uninstall(
    client: &kube::Client,
    kubeconfig: &std::path::Path,
    ns: &str,
    img: &str,
) -> anyhow::Result<()> {
    let cluster = shared_real_node().context("no real node")?;
    let registry = cluster.registry().context("the real node has no registry")?;
    let img2 = "opkit:in-cluster-test-2".to_string();
    let tool = String::from_utf8(
        Command::new("bash")
            .arg(repo().join("hack/container-tool.sh"))
            .output()?
            .stdout,
    )?;
    // An image of its own (a label on top), not a second tag of the first: the kubelet
    // (1.35, pulled-image credential checks) would count a loaded image that has the ID of a
    // pulled one as pulled, and try to pull it again from Docker Hub.
    let context = std::env::temp_dir().join(format!("opkit-img2-{}", std::process::id()));
    std::fs::create_dir_all(&context)?;
    std::fs::write(
        context.join("Containerfile"),
        format!("FROM {img}\nLABEL dev.opkit.test=upgrade\n"),
    )?;
    let built = Command::new(tool.trim())
        .args(["build", "-q", "-t", &img2, "-f"])
        .arg(context.join("Containerfile"))
        .arg(&context)
        .output()?;
    std::fs::remove_dir_all(&context)?;
    ensure!(
        built.status.success(),
        "building {img2}: {}",
        String::from_utf8_lossy(&built.stderr)
    );
    // Into the node the way `make testenv-load` does (kind load's counterpart), for this
    // test's own node.
    let archive = std::env::temp_dir().join(format!("opkit-in-cluster-{}.tar", std::process::id()));
    let out = Command::new("bash")
        .arg(repo().join("hack/testenv-load.sh"))
        .env("IMG", &img2)
        .env("ARCHIVE", &archive)
        .output()?;
    ensure!(
        out.status.success(),
        "saving {img2}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    cluster.load_image(&archive)?;
    std::fs::remove_file(&archive)?;
    // The OLM bundle image, with `make bundle-build bundle-push`.
    let bundle_img = format!("{registry}/opkit-bundle:v0.1.0");
    make(
        kubeconfig,
        &["bundle-build", "bundle-push", &format!("BUNDLE_IMG={bundle_img}")],
    )?;
    for (repository, tag) in [("opkit", "in-cluster-test"), ("opkit-bundle", "v0.1.0")] {
        let addr: std::net::SocketAddr = registry.parse()?;
        let (code, body) = http_get(addr, &format!("/v2/{repository}/tags/list")).await?;
        ensure!(
            code == 200 && body.contains(tag),
            "the registry lists for {repository}: {code} {body}"
        );
    }

    // `make undeploy` deleted the CRDs; the chart makes them again once they are gone.
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let ours: Vec<String> = serde_yaml::Deserializer::from_slice(
        &Command::new(env!("CARGO_BIN_EXE_opkit"))
            .arg("crd")
            .output()?
            .stdout,
    )
    .filter_map(|d| serde_yaml::Value::deserialize(d).ok())
    .filter_map(|v| v["metadata"]["name"].as_str().map(String::from))
    .collect();
    ensure!(!ours.is_empty(), "opkit crd printed no CRD");
    wait_for("the undeployed CRDs to be gone", T, || async {
        for name in &ours {
            ensure!(crds.get_opt(name).await?.is_none(), "{name} still there");
        }
        Ok(())
    })
    .await?;
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .create(
            &PostParams::default(),
            &Namespace {
                metadata: ObjectMeta {
                    name: Some(HELM_NS.into()),
                    annotations: Some(opkit_testenv::node::namespace_annotations()),
                    ..Default::default()
                },
                ..Default::default()
            },
        )
        .await?;
    let chart = repo().join("dist/chart");
    let chart = chart.to_str().context("chart path")?;
    let (repository, tag) = img.rsplit_once(':').context("the image has a tag")?;
    let installed = helm(
        kubeconfig,
        &[
            "install",
            "opkit",
            chart,
            "--wait",
            "--timeout",
            "3m",
            "--set",
            &format!("manager.image.repository={repository},manager.image.tag={tag}"),
        ],
    )?;
    ensure!(installed.contains("STATUS: deployed"), "{installed}");
    let deploys: Api<Deployment> = Api::namespaced(client.clone(), HELM_NS);
    let available = |n: i32, image: String| {
        let deploys = deploys.clone();
        async move {
            wait_for(&format!("{n} available replicas of {image}"), T, || async {
                let d = deploys.get("opkit-controller-manager").await?;
                let img = d
                    .spec
                    .as_ref()
                    .and_then(|s| s.template.spec.as_ref())
                    .and_then(|p| p.containers.first())
                    .and_then(|c| c.image.clone())
                    .unwrap_or_default();
                let st = d.status.unwrap_or_default();
                let done = img.ends_with(&image)
                    && st.available_replicas == Some(n)
                    && st.updated_replicas == Some(n)
                    && st.replicas == Some(n);
                if done {
                    Ok(())
                } else {
                    Err(anyhow!("image {img}, status {st:?}"))
                }
            })
            .await
        }
    };
    available(1, img.to_string()).await?;
    // Webhooks answer through the chart's Service, and the operator reconciles.
    let ancient = r#"{"apiVersion":"cnat.programming-kubernetes.info/v1alpha1","kind":"At",
        "metadata":{"name":"ancient"},"spec":{"schedule":"2010-01-01T00:00:00Z","command":"echo"}}"#;
    wait_for("the chart's At webhook to refuse an ancient At", T, || async {
        let (ok, out) = kubectl_stdin(
            &["create", "--dry-run=server", "-n", ns, "-f", "-"],
            ancient.as_bytes(),
        )?;
        ensure!(!ok && out.contains("more than 10 years in the past"), "{out}");
        Ok(())
    })
    .await?;
    let mc = r#"{"apiVersion":"cache.example.com/v1","kind":"Memcached","metadata":{"name":"from-helm"},"spec":{}}"#;
    let (ok, out) = kubectl_stdin(&["create", "-n", ns, "-f", "-"], mc.as_bytes())?;
    ensure!(ok, "{out}");
    jsonpath_is(
        &["memcached", "from-helm"],
        ns,
        "{.status.conditions[?(@.type==\"Available\")].status}",
        "True",
    )
    .await?;

    // The upgrade rolls the Pods while Ats (validated by a `Fail` webhook) are created.
    let stop = tokio_util::sync::CancellationToken::new();
    let creator = {
        let (stop, ns) = (stop.clone(), ns.to_string());
        tokio::task::spawn_blocking(move || {
            let (mut made, mut refused) = (0, Vec::new());
            let mut i = 0;
            while !stop.is_cancelled() {
                let at = format!(
                    r#"{{"apiVersion":"cnat.programming-kubernetes.info/v1alpha1","kind":"At",
                    "metadata":{{"name":"roll-{i}"}},"spec":{{"schedule":"2099-01-01T00:00:00Z","command":"echo"}}}}"#
                );
                match kubectl_stdin(&["create", "-n", &ns, "-f", "-"], at.as_bytes()) {
                    Ok((true, _)) => made += 1,
                    Ok((false, out)) => refused.push(out),
                    Err(e) => refused.push(e.to_string()),
                }
                i += 1;
                std::thread::sleep(Duration::from_millis(100));
            }
            (made, refused)
        })
    };
    let (repository2, tag2) = img2.rsplit_once(':').context("the pushed image has a tag")?;
    let upgraded = helm(
        kubeconfig,
        &[
            "upgrade",
            "opkit",
            chart,
            "--wait",
            "--timeout",
            "3m",
            "--reuse-values",
            "--set",
            &format!("manager.image.repository={repository2},manager.image.tag={tag2},manager.replicas=2"),
        ],
    );
    let rolled = match upgraded {
        Ok(_) => available(2, img2.clone()).await,
        Err(e) => Err(e),
    };
    stop.cancel();
    let (made, refused) = creator.await?;
    rolled?;
    println!(
        "helm upgrade: {made} Ats created during the roll, {} refused",
        refused.len()
    );
    ensure!(made > 0, "no At was created during the upgrade");
    ensure!(
        refused.is_empty(),
        "admissions failed during helm upgrade: {refused:?}"
    );

    helm(
        kubeconfig,
        &["rollback", "opkit", "1", "--wait", "--timeout", "3m"],
    )?;
    available(1, img.to_string()).await?;
    let history = helm(kubeconfig, &["history", "opkit"])?;
    ensure!(
        history.lines().count() == 4,
        "install, upgrade, rollback:\n{history}"
    );

    // Uninstall: everything goes but the CRDs (and so the custom objects), as the chart says.
    kubectl(&["delete", "memcached", "from-helm", "-n", ns, "--wait=true"])?;
    helm(kubeconfig, &["uninstall", "opkit", "--wait", "--timeout", "3m"])?;
    let kept = crds.get_opt("memcacheds.cache.example.com").await?;
    ensure!(
        kept.is_some(),
        "helm uninstall removed the Memcached CRD (the chart keeps it)"
    );
    let left: Vec<String> = [
        kubectl(&[
            "get",
            "deploy,sa,service,role,rolebinding,networkpolicy",
            "-n",
            HELM_NS,
            "-o",
            "name",
        ])?
        .lines()
        .filter(|l| !l.ends_with("/default") && !l.contains("kube-root-ca"))
        .map(String::from)
        .collect::<Vec<_>>(),
        kubectl(&[
            "get",
            "clusterroles,clusterrolebindings,mutatingwebhookconfigurations,validatingwebhookconfigurations",
            "-o",
            "name",
        ])?
        .lines()
        .filter(|l| l.contains("opkit"))
        .map(String::from)
        .collect(),
    ]
    .concat();
    ensure!(left.is_empty(), "helm uninstall left: {left:?}");
    // The CRDs are ours to remove now.
    let all = Command::new(env!("CARGO_BIN_EXE_opkit")).arg("crd").output()?;
    let (ok, out) = kubectl_stdin(
        &["delete", "--ignore-not-found", "--wait=true", "-f", "-"],
        &all.stdout,
    )?;
    ensure!(ok, "{out}");
    namespaces.delete(HELM_NS, &Default::default()).await?;
    Ok(())
}
