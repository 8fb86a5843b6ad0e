//! The generated RBAC grants nothing the operator does not use. `opkit run` (every controller,
//! leader election, webhooks, `--metrics-secure`) runs as the ServiceAccount of `config/rbac`,
//! bound to the generated ClusterRole and leader-election Role and nothing else, while a
//! scenario makes it do everything it does (PostgresDatabase on a throwaway PostgreSQL
//! server); afterwards the apiserver's audit log must show an allowed request of that account
//! for each (group, resource, verb, and name where the rule names objects) the two roles
//! grant, and no refused one.
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, ensure};
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Secret, ServiceAccount};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::rbac::v1::{ClusterRoleBinding, PolicyRule};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use opkit_api::at::At;
use opkit_api::config_mirror::ConfigMirror;
use opkit_api::eru::Eru;
use opkit_api::foo::Foo;
use opkit_api::memcached::Memcached;
use opkit_api::postgres::{PostgresDatabase, SERVER_LABEL};
use opkit_testenv::{ControlPlane, Options, https_get, wait_for};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::json;

mod common;
use common::{Audited, Running, free_port, read_audit, run_kubectl};

/// The operator's namespace and ServiceAccount, as `config/rbac` names them.
const NS: &str = "opkit-system";
const SA: &str = "opkit-controller-manager";
/// Where the scenario's objects live.
const WORK: &str = "rbac";
/// The namespace the ConfigMirror copies into.
const MIRRORED: &str = "rbac-mirrored";
const T: Duration = Duration::from_secs(60);

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// One thing a role allows: `verb` on `group`/`resource`, on the object `name` only when the
/// rule lists resourceNames.
#[derive(Debug)]
struct Grant {
    role: String,
    group: String,
    resource: String,
    verb: String,
    name: Option<String>,
}

impl std::fmt::Display for Grant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let group = if self.group.is_empty() {
            "core"
        } else {
            &self.group
        };
        write!(f, "{}: {} {} ({group})", self.role, self.verb, self.resource)?;
        match &self.name {
            Some(n) => write!(f, " named {n}"),
            None => Ok(()),
        }
    }
}

/// Every grant of the (Cluster)Role in the generated file `path`.
fn grants(path: &Path) -> anyhow::Result<Vec<Grant>> {
    let text = std::fs::read_to_string(path).with_context(|| path.display().to_string())?;
    let role: serde_json::Value = serde_yaml::from_str(&text)?;
    let name = format!(
        "{} {}",
        role["kind"].as_str().unwrap_or_default(),
        role["metadata"]["name"].as_str().unwrap_or_default()
    );
    let rules: Vec<PolicyRule> = serde_json::from_value(role["rules"].clone())?;
    let mut out = Vec::new();
    for r in rules {
        let names: Vec<Option<String>> = match r.resource_names {
            Some(n) if !n.is_empty() => n.into_iter().map(Some).collect(),
            _ => vec![None],
        };
        for group in r.api_groups.iter().flatten() {
            for resource in r.resources.iter().flatten() {
                for verb in &r.verbs {
                    for n in &names {
                        out.push(Grant {
                            role: name.clone(),
                            group: group.clone(),
                            resource: resource.clone(),
                            verb: verb.clone(),
                            name: n.clone(),
                        });
                    }
                }
            }
        }
    }
    Ok(out)
}

/// The request's resource as RBAC names it (`memcacheds/status`).
fn resource_of(a: &Audited) -> String {
    if a.subresource.is_empty() {
        a.resource.clone()
    } else {
        format!("{}/{}", a.resource, a.subresource)
    }
}

/// Whether the allowed request `a` used `g`. A server-side apply that created its object
/// (`patch` answered 201) was also authorized as a `create`; a watch that streams its initial
/// list stands for the list (which a server without streaming gets instead).
fn uses(a: &Audited, g: &Grant) -> bool {
    let verb = a.verb == g.verb
        || (g.verb == "create" && a.verb == "patch" && a.code == 201)
        || (g.verb == "list" && a.verb == "watch" && a.streams_list);
    a.decision == "allow"
        && verb
        && a.group == g.group
        && resource_of(a) == g.resource
        && g.name.as_ref().is_none_or(|n| *n == a.name)
}

/// The grants no request of `user` used, and the requests of `user` RBAC refused (a 403 with
/// an allowed verb: an apply that would have created its object without `create`).
fn unused_and_refused<'a>(
    grants: &'a [Grant],
    audit: &[Audited],
    user: &str,
) -> (Vec<&'a Grant>, Vec<String>) {
    let mine: Vec<&Audited> = audit.iter().filter(|a| a.user == user).collect();
    let unused = grants
        .iter()
        .filter(|g| !mine.iter().any(|a| uses(a, g)))
        .collect();
    let refused = mine
        .iter()
        .filter(|a| a.decision == "forbid" || a.code == 403)
        .map(|a| format!("{} {} {:?} ({})", a.verb, resource_of(a), a.name, a.group))
        .collect();
    (unused, refused)
}

/// `create` of `body` (JSON) through `api`.
async fn create<K>(api: &Api<K>, body: serde_json::Value) -> anyhow::Result<K>
where
    K: Clone + DeserializeOwned + Serialize + std::fmt::Debug,
{
    Ok(api
        .create(&PostParams::default(), &serde_json::from_value(body)?)
        .await?)
}

/// A JSON merge patch of `name`.
async fn merge<K>(api: &Api<K>, name: &str, patch: serde_json::Value) -> anyhow::Result<K>
where
    K: Clone + DeserializeOwned + std::fmt::Debug,
{
    Ok(api
        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?)
}

/// Waits until `api` has no object `name`.
async fn gone<K>(api: &Api<K>, what: &str, name: &str) -> anyhow::Result<()>
where
    K: Clone + DeserializeOwned + std::fmt::Debug,
{
    wait_for(&format!("{what} {name} to be deleted"), T, || async {
        match api.get_opt(name).await? {
            None => Ok(()),
            Some(_) => Err(anyhow!("still there")),
        }
    })
    .await
}

/// `opkit run` with every controller and leader election, as the ServiceAccount of
/// `kubeconfig`, with `args`; killed on drop. Also returns its log's path.
fn opkit(
    cp: &ControlPlane,
    kubeconfig: &Path,
    name: &str,
    args: &[&str],
) -> anyhow::Result<(Running, PathBuf)> {
    let log = cp.dir().join(format!("{name}.log"));
    let output = std::fs::File::create(&log)?;
    let child = Command::new(env!("CARGO_BIN_EXE_opkit"))
        .args(["run", "--leader-elect", "--leader-election-namespace", NS])
        .args(["--health-probe-bind-address", "0"])
        .args(args)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .env("POD_NAME", name)
        .env("POD_NAMESPACE", NS)
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stdout(output.try_clone()?)
        .stderr(output)
        .spawn()?;
    Ok((Running(child), log))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_verb_the_generated_roles_grant_is_used_by_the_operator() -> anyhow::Result<()> {
    let start = Instant::now();
    let cp = ControlPlane::start(Options {
        audit_log: true,
        nodes: 1,
        ..Default::default()
    })
    .await?;
    let client = cp.client().await?;
    let kubectl = |args: &[&str]| {
        let mut c = Command::new(cp.binaries().path("kubectl"));
        c.env("KUBECONFIG", cp.kubeconfig_path());
        run_kubectl(c, args)
    };
    let config = |dir: &str| root().join("config").join(dir).display().to_string();

    // Installed as `make install` and `make deploy` do: the CRDs, then config/rbac (the
    // ServiceAccount, the generated roles and their bindings, the metrics reader). The webhook
    // configurations exist before the operator starts (config/webhook makes them); it only
    // keeps them current, here pointing them at its local URL.
    kubectl(&["apply", "--server-side", "-k", &config("crd")])?;
    kubectl(&["create", "namespace", NS])?;
    kubectl(&["apply", "--server-side", "-k", &config("rbac")])?;
    let mwc: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    create(
        &mwc,
        json!({"metadata": {"name": "opkit-mutating-webhook-configuration"}}),
    )
    .await?;
    let vwc: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    create(
        &vwc,
        json!({"metadata": {"name": "opkit-validating-webhook-configuration"}}),
    )
    .await?;
    kubectl(&[
        "wait",
        "--for=condition=Established",
        "crd",
        "--all",
        "--timeout=60s",
    ])?;
    // Who scrapes /metrics: a ServiceAccount bound to the metrics-reader ClusterRole.
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), NS);
    create(&sas, json!({"metadata": {"name": "scraper"}})).await?;
    let crbs: Api<ClusterRoleBinding> = Api::all(client.clone());
    create(
        &crbs,
        json!({
            "metadata": {"name": "rbac-test-scraper"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "opkit-metrics-reader"},
            "subjects": [{"kind": "ServiceAccount", "name": "scraper", "namespace": NS}],
        }),
    )
    .await?;

    let token = common::service_account_token(&client, NS, SA).await?;
    let kubeconfig = cp.dir().join("operator.kubeconfig");
    std::fs::write(
        &kubeconfig,
        opkit_testenv::kubeconfig_with_token(&cp.kubeconfig_path(), &token)?,
    )?;
    let (metrics, webhook) = (free_port()?, free_port()?);
    let operator = opkit(
        &cp,
        &kubeconfig,
        "opkit-rbac",
        &[
            "--metrics-bind-address",
            &format!("127.0.0.1:{metrics}"),
            "--metrics-secure",
            "--webhook-bind-address",
            &format!("127.0.0.1:{webhook}"),
            "--webhook-url",
            &format!("https://127.0.0.1:{webhook}"),
        ],
    )?;
    let logs = || {
        format!(
            "--- opkit log ---\n{}",
            std::fs::read_to_string(&operator.1).unwrap_or_default()
        )
    };
    // Leader election: the Lease created, then renewed (update).
    let leases: Api<Lease> = Api::namespaced(client.clone(), NS);
    // Whether the Lease is held by a replica of the POD_NAME `replica`.
    let held_by = |replica: &'static str| {
        let leases = leases.clone();
        move || {
            let leases = leases.clone();
            async move {
                let holder = leases
                    .get_opt("opkit-leader")
                    .await?
                    .and_then(|l| l.spec?.holder_identity)
                    .unwrap_or_default();
                ensure!(holder.starts_with(&format!("{replica}_")), "holder {holder:?}");
                anyhow::Ok(())
            }
        }
    };
    wait_for("the operator to take the Lease", T, held_by("opkit-rbac"))
        .await
        .with_context(logs)?;
    // A standby replica lists and watches the Lease while it waits (no webhooks nor metrics:
    // those are the leader's here).
    let standby = opkit(
        &cp,
        &kubeconfig,
        "opkit-rbac-standby",
        &["--metrics-bind-address", "0", "--webhook-bind-address", "0"],
    )?;
    println!(
        "[{:5.1}s] operator leads, standby started",
        start.elapsed().as_secs_f64()
    );
    scenario(&client, metrics).await.with_context(logs)?;
    println!("[{:5.1}s] scenario done", start.elapsed().as_secs_f64());
    let audit_log = cp.dir().join("audit.log");
    let user = format!("system:serviceaccount:{NS}:{SA}");

    // Forty requests at once with one made-up token: one TokenReview, not forty, and each
    // refused. (The audit log is written before each request is answered: complete.)
    let reviews = || -> anyhow::Result<usize> {
        Ok(read_audit(&audit_log)?
            .iter()
            .filter(|a| a.user == user && a.resource == "tokenreviews")
            .count())
    };
    let before = reviews()?;
    let addr = ([127, 0, 0, 1], metrics).into();
    let flood = (0..40).map(|_| https_get(addr, "/metrics", Some("made-up-token")));
    for answer in futures::future::join_all(flood).await {
        let (code, body) = answer?;
        ensure!(code == 401, "a made-up token got {code}: {body}");
    }
    let made = reviews()? - before;
    ensure!(
        made == 1,
        "{made} TokenReviews for one token asked about 40 times at once"
    );
    wait_for("the standby to watch the Lease", T, || async {
        let watching = read_audit(&audit_log)?
            .iter()
            .any(|a| a.user == user && a.verb == "watch" && a.resource == "leases");
        ensure!(watching, "no watch of the Lease");
        Ok(())
    })
    .await
    .with_context(|| {
        format!(
            "--- standby log ---\n{}",
            std::fs::read_to_string(&standby.1).unwrap_or_default()
        )
    })?;

    // A graceful stop: the leader reads its Lease to release it (a renewal writes without
    // reading while nobody else has changed the Lease), and the standby takes it over.
    common::sigterm(operator.0.0.id());
    wait_for("the standby to take the Lease", T, held_by("opkit-rbac-standby"))
        .await
        .with_context(logs)?;

    // The audit log is written before each request is answered (blocking mode): complete.
    let audit = read_audit(&audit_log)?;
    let mut granted = grants(&root().join("config/rbac/role.yaml"))?;
    granted.extend(grants(&root().join("config/rbac/leader_election_role.yaml"))?);
    let (unused, refused) = unused_and_refused(&granted, &audit, &user);
    let requests = audit.iter().filter(|a| a.user == user).count();
    println!(
        "{requests} requests of the operator, {} grants, {} unused, {} refused",
        granted.len(),
        unused.len(),
        refused.len()
    );
    let unused: Vec<String> = unused.into_iter().map(|g| g.to_string()).collect();
    let mut problems = Vec::new();
    for (list, what) in [
        (
            unused,
            "granted but never used by the operator (remove each where it is declared, or make \
             this scenario use it)",
        ),
        (refused, "refused by RBAC (the roles lack what the operator uses)"),
    ] {
        if !list.is_empty() {
            problems.push(format!("{what}:\n  {}", list.join("\n  ")));
        }
    }
    ensure!(problems.is_empty(), "{}", problems.join("\n"));
    Ok(())
}

/// Makes the operator use everything its roles grant, waiting for each effect.
async fn scenario(client: &kube::Client, metrics: u16) -> anyhow::Result<()> {
    // Webhooks: the shared certificate's Secret created, the configurations applied.
    let vwc: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    wait_for("the operator to configure its webhooks", T, || async {
        let hooks = vwc
            .get("opkit-validating-webhook-configuration")
            .await?
            .webhooks
            .unwrap_or_default();
        ensure!(!hooks.is_empty(), "no webhooks yet");
        Ok(())
    })
    .await?;
    // Secure metrics: the scraper's token reviewed, its access to /metrics asked about.
    let scraper = common::service_account_token(client, NS, "scraper").await?;
    wait_for("/metrics to answer the scraper", T, || async {
        match https_get(([127, 0, 0, 1], metrics).into(), "/metrics", Some(&scraper)).await {
            Ok((200, _)) => Ok(()),
            Ok((code, body)) => Err(anyhow!("{code}: {}", &body[..body.len().min(200)])),
            Err(e) => Err(anyhow!("{e}")),
        }
    })
    .await?;

    let namespaces: Api<Namespace> = Api::all(client.clone());
    create(&namespaces, json!({"metadata": {"name": WORK}})).await?;
    create(
        &namespaces,
        json!({"metadata": {"name": MIRRORED, "labels": {"rbac-test/mirror": "yes"}}}),
    )
    .await?;

    // At: runs at once (a Pod read, then created), finishes, and is deleted one second later.
    let ats: Api<At> = Api::namespaced(client.clone(), WORK);
    let now = k8s_openapi::jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string();
    let at = json!({
        "apiVersion": "cnat.programming-kubernetes.info/v1alpha1", "kind": "At",
        "metadata": {"name": "once"},
        "spec": {"schedule": now, "command": "echo done", "ttlSecondsAfterFinished": 1},
    });
    wait_for("the At to be admitted", T, || create(&ats, at.clone())).await?;
    // Memcached: its Deployment created by an apply, its status written.
    let mcs: Api<Memcached> = Api::namespaced(client.clone(), WORK);
    create(
        &mcs,
        json!({"apiVersion": "cache.example.com/v1", "kind": "Memcached", "metadata": {"name": "mc"}, "spec": {"size": 1}}),
    )
    .await?;
    // Foo: its Deployment read (absent), then created.
    let foos: Api<Foo> = Api::namespaced(client.clone(), WORK);
    create(
        &foos,
        json!({"apiVersion": "samplecontroller.k8s.io/v1alpha1", "kind": "Foo", "metadata": {"name": "foo"},
               "spec": {"deploymentName": "foo-a", "replicas": 1}}),
    )
    .await?;
    // Eru: a Deployment annotated for restarts every 3 s gets its Eru; each restart patches
    // the Deployment and repeats the `Restarted` Event (so the Event is patched).
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), WORK);
    create(
        &deployments,
        json!({
            "metadata": {"name": "web", "annotations": {
                "mtsre.meitu.com/eru": "true", "mtsre.meitu.com/eru-schedule": "*/3 * * * * *"}},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": {"app": "web"}},
                "template": {"metadata": {"labels": {"app": "web"}},
                             "spec": {"containers": [{"name": "web", "image": "nginx"}]}},
            },
        }),
    )
    .await?;
    // ConfigMirror: a source copied into the labelled namespace.
    let configmaps: Api<ConfigMap> = Api::namespaced(client.clone(), WORK);
    create(
        &configmaps,
        json!({"metadata": {"name": "settings"}, "data": {"level": "info"}}),
    )
    .await?;
    let mirrors: Api<ConfigMirror> = Api::all(client.clone());
    let mirror = json!({
        "apiVersion": "mirror.opkit.dev/v1alpha1", "kind": "ConfigMirror",
        "metadata": {"name": "settings"},
        "spec": {"source": {"namespace": WORK, "name": "settings"},
                 "namespaceSelector": {"matchLabels": {"rbac-test/mirror": "yes"}}},
    });
    wait_for("the ConfigMirror to be admitted", T, || {
        create(&mirrors, mirror.clone())
    })
    .await?;

    // The shared webhook certificate made for other hosts: the operator's next look (every
    // 30 s) replaces it. Done after the creates above, which the At webhook must admit.
    let secrets: Api<Secret> = Api::namespaced(client.clone(), NS);
    merge(
        &secrets,
        "opkit-webhook-server-cert",
        json!({"metadata": {"annotations": {"opkit.dev/hosts": "elsewhere"}}}),
    )
    .await?;

    wait_for("the Memcached's status to show its ready Pod", T, || async {
        let ready = mcs.get("mc").await?.status.and_then(|s| s.ready_replicas);
        ensure!(ready == Some(1), "readyReplicas {ready:?}");
        Ok(())
    })
    .await?;

    // Foo: its status written; a new deploymentName creates that one and prunes the old.
    wait_for("the Foo's status to show its available Pod", T, || async {
        let available = foos.get("foo").await?.status.map(|s| s.available_replicas);
        ensure!(available == Some(1), "availableReplicas {available:?}");
        Ok(())
    })
    .await?;
    merge(&foos, "foo", json!({"spec": {"deploymentName": "foo-b"}})).await?;
    wait_for("the Foo's new Deployment", T, || async {
        deployments.get("foo-b").await.map(|_| ())
    })
    .await?;
    gone(&deployments, "the Foo's old Deployment", "foo-a").await?;

    // ConfigMirror: the copy made (applied), then following its source (patched), then
    // removed with the mirror (deleted, the finalizer taken off).
    let copies: Api<ConfigMap> = Api::namespaced(client.clone(), MIRRORED);
    wait_for("the ConfigMirror's copy", T, || async {
        copies.get("settings").await.map(|_| ())
    })
    .await?;
    merge(&configmaps, "settings", json!({"data": {"level": "debug"}})).await?;
    wait_for("the copy to follow its source", T, || async {
        let level = copies
            .get("settings")
            .await?
            .data
            .unwrap_or_default()
            .remove("level");
        ensure!(level.as_deref() == Some("debug"), "level {level:?}");
        Ok(())
    })
    .await?;
    mirrors.delete("settings", &DeleteParams::default()).await?;
    gone(&mirrors, "the ConfigMirror", "settings").await?;
    gone(&copies, "the copy", "settings").await?;

    // Eru: two restarts (the second `Restarted` Event patches the first), a new schedule (the
    // Eru is patched), then the annotation removed: the Eru is deleted.
    let erus: Api<Eru> = Api::namespaced(client.clone(), WORK);
    wait_for("the Eru to restart its Deployment twice", T, || async {
        let count = erus.get("web").await?.status.map(|s| s.restart_count);
        ensure!(count >= Some(2), "restartCount {count:?}");
        Ok(())
    })
    .await?;
    let events: Api<Event> = Api::namespaced(client.clone(), WORK);
    wait_for("an Event repeated (a series)", T, || async {
        let repeated = events
            .list(&Default::default())
            .await?
            .items
            .iter()
            .any(|e| e.series.as_ref().is_some_and(|s| s.count >= 2));
        ensure!(repeated, "no Event with a series");
        Ok(())
    })
    .await?;
    // The schedule annotation changed: the Eru opkit made (with a POST) is applied anew.
    merge(
        &deployments,
        "web",
        json!({"metadata": {"annotations": {"mtsre.meitu.com/eru-schedule": "*/4 * * * * *"}}}),
    )
    .await?;
    wait_for("the Eru to take the new schedule", T, || async {
        let schedule = erus.get("web").await?.spec.schedule;
        ensure!(schedule == "*/4 * * * * *", "schedule {schedule:?}");
        Ok(())
    })
    .await?;
    merge(
        &deployments,
        "web",
        json!({"metadata": {"annotations": {"mtsre.meitu.com/eru": null}}}),
    )
    .await?;
    gone(&erus, "the annotation's Eru", "web").await?;

    postgres(client).await?;

    gone(&ats, "the finished At", "once").await?;
    wait_for("the operator to replace the webhook certificate", T, || async {
        let hosts = secrets
            .get("opkit-webhook-server-cert")
            .await?
            .metadata
            .annotations
            .unwrap_or_default()
            .remove("opkit.dev/hosts");
        ensure!(hosts.as_deref() == Some("127.0.0.1"), "hosts {hosts:?}");
        Ok(())
    })
    .await?;
    Ok(())
}

/// PostgresDatabase on a throwaway server: its finalizer added and removed and its status
/// written (patch); its Secret created, applied again for a new password (patch), and pruned
/// when the spec names another one (delete).
async fn postgres(client: &kube::Client) -> anyhow::Result<()> {
    let pg = opkit_testenv::postgres::Postgres::start()?;
    let secrets: Api<Secret> = Api::namespaced(client.clone(), WORK);
    create(
        &secrets,
        json!({
            "metadata": {"name": "pg", "labels": {SERVER_LABEL: "true"}},
            "stringData": {"host": pg.host, "port": pg.port.to_string(), "username": pg.user, "password": pg.password},
        }),
    )
    .await?;
    let dbs: Api<PostgresDatabase> = Api::namespaced(client.clone(), WORK);
    create(
        &dbs,
        json!({"apiVersion": "db.opkit.dev/v1alpha1", "kind": "PostgresDatabase", "metadata": {"name": "app"},
               "spec": {"serverSecret": "pg", "reclaimPolicy": "Delete"}}),
    )
    .await?;
    let ready = |generation: i64| {
        let dbs = dbs.clone();
        move || {
            let dbs = dbs.clone();
            async move {
                let status = dbs.get("app").await?.status.unwrap_or_default();
                let ready = status.conditions.iter().find(|c| c.type_ == "Ready");
                ensure!(
                    ready.is_some_and(|c| c.status == "True" && c.observed_generation == Some(generation)),
                    "Ready {ready:?}"
                );
                Ok(())
            }
        }
    };
    wait_for("the PostgresDatabase ready", T, ready(1)).await?;
    let password = || async {
        let s = secrets.get("app-postgres").await?;
        anyhow::Ok(s.data.unwrap_or_default().remove("password").map(|p| p.0))
    };
    let first = password().await?;
    merge(&dbs, "app", json!({"spec": {"passwordRevision": 1}})).await?;
    wait_for("the password rotated", T, || async {
        ensure!(password().await? != first, "the same password");
        Ok(())
    })
    .await?;
    merge(&dbs, "app", json!({"spec": {"secretName": "app-db"}})).await?;
    wait_for("the PostgresDatabase ready with its new Secret", T, ready(3)).await?;
    gone(&secrets, "the old Secret", "app-postgres").await?;
    dbs.delete("app", &DeleteParams::default()).await?;
    gone(&dbs, "the PostgresDatabase", "app").await?;
    Ok(())
}

#[test]
fn a_grant_no_allowed_request_used_is_reported() {
    let grant = |resource: &str, verb: &str, name: Option<&str>| Grant {
        role: "ClusterRole r".into(),
        group: "apps".into(),
        resource: resource.into(),
        verb: verb.into(),
        name: name.map(Into::into),
    };
    let request = |resource: &str, subresource: &str, verb: &str, name: &str, code: i64| Audited {
        user: "op".into(),
        verb: verb.into(),
        group: "apps".into(),
        resource: resource.into(),
        subresource: subresource.into(),
        name: name.into(),
        code,
        message: String::new(),
        decision: "allow".into(),
        received: String::new(),
        done: String::new(),
        streams_list: false,
    };
    let granted = vec![
        grant("deployments", "list", None),
        grant("replicasets", "list", None),
        grant("deployments", "create", None),
        grant("deployments/status", "patch", None),
        grant("deployments", "get", Some("a")),
        grant("deployments", "delete", None),
    ];
    let mut refused = request("deployments", "", "delete", "x", 403);
    refused.decision = "forbid".into();
    let audit = vec![
        request("deployments", "", "list", "", 200),
        // A watch that streams its initial list stands for the list.
        Audited {
            streams_list: true,
            ..request("replicasets", "", "watch", "", 200)
        },
        // A server-side apply that created its object was authorized as a create too.
        request("deployments", "", "patch", "x", 201),
        request("deployments", "status", "patch", "x", 200),
        // Another name than the rule's.
        request("deployments", "", "get", "b", 200),
        refused,
    ];
    let (unused, refused) = unused_and_refused(&granted, &audit, "op");
    let unused: Vec<String> = unused.iter().map(|g| g.to_string()).collect();
    assert_eq!(
        unused,
        [
            "ClusterRole r: get deployments (apps) named a",
            "ClusterRole r: delete deployments (apps)"
        ]
    );
    assert_eq!(refused, ["delete deployments \"x\" (apps)"]);
    // Someone else's requests count for nothing.
    let (unused, _) = unused_and_refused(&granted, &audit, "someone");
    assert_eq!(unused.len(), granted.len());
}

/// The documents of a generated YAML file, as JSON.
fn yaml_docs(path: &Path) -> anyhow::Result<Vec<serde_json::Value>> {
    let text = std::fs::read_to_string(path)?;
    let mut out = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(&text) {
        let v: serde_json::Value = serde::Deserialize::deserialize(doc)?;
        if !v.is_null() {
            out.push(v);
        }
    }
    Ok(out)
}

/// `config/sharding`'s ValidatingAdmissionPolicy, bound to one namespace: a user with patch
/// rights cannot change, add or remove a shard or drain label, nor a member Lease's labels,
/// while changing any other label; the manager's ServiceAccount, with the sharding
/// ClusterRole, can.
#[tokio::test]
async fn only_the_operator_changes_shard_and_drain_labels() {
    opkit_testenv::shared()
        .in_namespace("shard-labels", |_client, ns| async move {
            common::install_crds()?;
            let sharding = root().join("config/sharding");
            let mut objects = yaml_docs(&sharding.join("shard_label_policy.yaml"))?;
            objects.extend(yaml_docs(&sharding.join("sharding_cluster_role.yaml"))?);
            let name = format!("shard-labels-{ns}");
            for o in &mut objects {
                o["metadata"]["name"] = json!(name);
                match o["kind"].as_str() {
                    Some("ValidatingAdmissionPolicyBinding") => {
                        o["spec"]["policyName"] = json!(name);
                        o["spec"]["matchResources"] =
                            json!({"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}});
                    }
                    Some("ClusterRole") | Some("ValidatingAdmissionPolicy") => {}
                    other => anyhow::bail!("unexpected {other:?}"),
                }
            }
            objects.push(json!({
                "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                "metadata": {"name": name},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
                "subjects": [{"kind": "ServiceAccount", "name": "manager", "namespace": ns}],
            }));
            // alice may patch Memcacheds and Leases here, as a namespace's editor may: the
            // policy, not RBAC, must stop her.
            objects.push(json!({
                "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                "metadata": {"name": "editor", "namespace": ns},
                "rules": [
                    {"apiGroups": ["cache.example.com"], "resources": ["memcacheds"], "verbs": ["get", "patch", "update"]},
                    {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "patch", "update"]},
                ],
            }));
            objects.push(json!({
                "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                "metadata": {"name": "editor", "namespace": ns},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "editor"},
                "subjects": [
                    {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "alice"},
                    // The manager reads what it labels (its own ClusterRole grants that).
                    {"kind": "ServiceAccount", "name": "manager", "namespace": ns},
                ],
            }));
            objects.push(json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "manager", "namespace": ns}}));
            // `m` for the checks; `probe` to learn when the policy is in force (an update
            // admitted before that must not change what `m` starts from).
            for name in ["m", "probe"] {
                objects.push(json!({
                    "apiVersion": "cache.example.com/v1", "kind": "Memcached",
                    "metadata": {"name": name, "namespace": ns, "labels": {"app": "x", "shard.opkit.dev/memcached": "a"}},
                    "spec": {"size": 1},
                }));
            }
            objects.push(json!({
                "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": "member-a", "namespace": ns,
                             "labels": {"shard.opkit.dev/group": "g", "shard.opkit.dev/member": "a"}},
            }));
            let list = json!({"apiVersion": "v1", "kind": "List", "items": objects});
            let (ok, out) = common::kubectl_stdin(&["apply", "-f", "-"], list.to_string().as_bytes())?;
            ensure!(ok, "{out}");
            let result = async {
                let label = |user: &str, kind: &str, obj: &str, change: &str| {
                    common::kubectl(&["--as", user, "label", kind, obj, "-n", &ns, change, "--overwrite"])
                };
                let refused = |r: anyhow::Result<String>| match r {
                    Err(e) if e.to_string().contains("only the operator changes them") => Ok(()),
                    other => Err(anyhow!("not refused by the policy: {other:?}")),
                };
                let attempt = std::sync::atomic::AtomicUsize::new(0);
                wait_for("the policy to refuse alice's shard label", T, || async {
                    // A new value each time: kubectl sends nothing for a label it already has.
                    let n = attempt.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    refused(label("alice", "memcached", "probe", &format!("shard.opkit.dev/memcached=p{n}")))
                })
                .await?;
                refused(label("alice", "memcached", "m", "shard.opkit.dev/memcached=b"))?;
                label("alice", "memcached", "m", "app=y").context("another label")?;
                refused(label("alice", "memcached", "m", "shard.opkit.dev/memcached-"))?;
                refused(label("alice", "memcached", "m", "drain.shard.opkit.dev/memcached=b"))?;
                refused(label("alice", "lease", "member-a", "shard.opkit.dev/member-"))?;
                label("alice", "lease", "member-a", "note=x").context("another Lease label")?;
                let manager = format!("system:serviceaccount:{ns}:manager");
                label(&manager, "memcached", "m", "shard.opkit.dev/memcached=b").context("the manager")?;
                label(&manager, "memcached", "m", "drain.shard.opkit.dev/memcached=c").context("the manager")?;
                let labels = common::kubectl(&["get", "memcached", "m", "-n", &ns, "-o", "jsonpath={.metadata.labels}"])?;
                ensure!(labels.contains("\"shard.opkit.dev/memcached\":\"b\"") && labels.contains("\"app\":\"y\""), "{labels}");
                anyhow::Ok(())
            }
            .await;
            let _ = common::kubectl(&[
                "delete",
                "validatingadmissionpolicybinding,validatingadmissionpolicy,clusterrolebinding,clusterrole",
                &name,
            ]);
            result
        })
        .await;
}
