//! The local control plane behaves like a real cluster: workloads run, CRDs are served,
//! one-shot Pods finish, garbage collection and RBAC work.
use std::time::Duration;

use anyhow::{Context, anyhow, bail, ensure};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DeleteParams, DynamicObject, GroupVersionKind, PostParams};
use kube::discovery::ApiResource;
use kube::{Client, ResourceExt};
use opkit_testenv::{ControlPlane, EXIT_CODE_ANNOTATION, Options, shared, wait_for};
use serde_json::json;

const T: Duration = Duration::from_secs(60);

async fn create<K>(api: &Api<K>, value: serde_json::Value) -> anyhow::Result<K>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + serde::Serialize + std::fmt::Debug,
{
    Ok(api
        .create(&PostParams::default(), &serde_json::from_value(value)?)
        .await?)
}

#[tokio::test]
async fn a_deployment_of_three_replicas_gets_three_ready_pods() {
    shared()
        .in_namespace("deploy", |client, ns| async move {
            let deploys: Api<Deployment> = Api::namespaced(client.clone(), &ns);
            create(
                &deploys,
                json!({
                    "metadata": {"name": "web"},
                    "spec": {"replicas": 3, "selector": {"matchLabels": {"app": "web"}},
                        "template": {"metadata": {"labels": {"app": "web"}},
                            "spec": {"containers": [{"name": "web", "image": "nginx"}]}}}
                }),
            )
            .await?;
            wait_for("3 ready replicas", T, || async {
                let d = deploys.get("web").await?;
                let ready = d.status.and_then(|s| s.ready_replicas).unwrap_or(0);
                if ready == 3 {
                    Ok(())
                } else {
                    Err(anyhow!("{ready} ready"))
                }
            })
            .await?;
            let pods: Api<Pod> = Api::namespaced(client, &ns);
            let running = pods
                .list(&Default::default())
                .await?
                .items
                .into_iter()
                .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
                .count();
            ensure!(running == 3, "expected 3 Running pods, found {running}");
            Ok(())
        })
        .await;
}

#[tokio::test]
async fn a_crd_installed_at_run_time_is_served_and_objects_round_trip() {
    shared()
        .in_namespace("crd", |client, ns| async move {
            let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
            let group = format!("{ns}.testenv.opkit.dev");
            let name = format!("crontabs.{group}");
            create(&crds, json!({
                "metadata": {"name": name},
                "spec": {"group": group, "scope": "Namespaced",
                    "names": {"plural": "crontabs", "singular": "crontab", "kind": "CronTab", "shortNames": ["ct"]},
                    "versions": [{"name": "v1", "served": true, "storage": true, "schema": {"openAPIV3Schema": {
                        "type": "object", "properties": {"spec": {"type": "object", "properties": {
                            "cronSpec": {"type": "string"}, "replicas": {"type": "integer"}}}}}}}]}
            }))
            .await?;
            let gvk = GroupVersionKind::gvk(&group, "v1", "CronTab");
            let ar = ApiResource::from_gvk_with_plural(&gvk, "crontabs");
            let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &ar);
            let obj: DynamicObject = serde_json::from_value(json!({
                "apiVersion": format!("{group}/v1"), "kind": "CronTab",
                "metadata": {"name": "my-new-cron-object"},
                "spec": {"cronSpec": "* * * * */5", "replicas": 2}
            }))?;
            // The CRD becomes Established asynchronously: retry the create until it is served.
            wait_for("the CRD to be served", T, || async { api.create(&PostParams::default(), &obj).await }).await?;
            let back = api.get("my-new-cron-object").await?;
            ensure!(back.data["spec"] == json!({"cronSpec": "* * * * */5", "replicas": 2}), "round trip changed the spec: {:?}", back.data);
            crds.delete(&name, &DeleteParams::default()).await?;
            Ok(())
        })
        .await;
}

fn one_shot(name: &str, script: &str, exit_code: Option<&str>) -> serde_json::Value {
    let annotations = match exit_code {
        Some(c) => json!({ EXIT_CODE_ANNOTATION: c }),
        None => json!({}),
    };
    json!({"metadata": {"name": name, "annotations": annotations},
        "spec": {"restartPolicy": "Never", "containers": [{"name": "c", "image": "busybox", "command": ["sh", "-c", script]}]}})
}

async fn terminal_phase(pods: &Api<Pod>, name: &str) -> anyhow::Result<(String, i32)> {
    wait_for(&format!("pod {name} to finish"), T, || async {
        let p = pods.get(name).await?;
        let status = p.status.unwrap_or_default();
        let phase = status.phase.unwrap_or_default();
        if phase != "Succeeded" && phase != "Failed" {
            bail!("phase {phase}");
        }
        let code = status
            .container_statuses
            .unwrap_or_default()
            .first()
            .and_then(|c| c.state.as_ref()?.terminated.as_ref().map(|t| t.exit_code))
            .context("no terminated container state")?;
        Ok((phase, code))
    })
    .await
}

#[tokio::test]
async fn one_shot_pods_end_as_their_script_or_annotation_says() {
    shared()
        .in_namespace("oneshot", |client, ns| async move {
            let pods: Api<Pod> = Api::namespaced(client, &ns);
            let started = std::time::Instant::now();
            create(&pods, one_shot("ok", "echo YAY", None)).await?;
            create(&pods, one_shot("annotated", "echo YAY", Some("3"))).await?;
            create(&pods, one_shot("exits", "exit 7", None)).await?;
            create(&pods, one_shot("false", "false", None)).await?;
            create(&pods, one_shot("sleeps", "sleep 4", None)).await?;
            ensure!(terminal_phase(&pods, "ok").await? == ("Succeeded".into(), 0));
            ensure!(terminal_phase(&pods, "annotated").await? == ("Failed".into(), 3));
            ensure!(terminal_phase(&pods, "exits").await? == ("Failed".into(), 7));
            ensure!(terminal_phase(&pods, "false").await? == ("Failed".into(), 1));
            ensure!(terminal_phase(&pods, "sleeps").await? == ("Succeeded".into(), 0));
            let took = started.elapsed();
            ensure!(took >= Duration::from_secs(4), "`sleep 4` ended after {took:?}");
            Ok(())
        })
        .await;
}

#[tokio::test]
async fn deleting_an_owner_garbage_collects_its_dependents() {
    shared()
        .in_namespace("gc", |client, ns| async move {
            let cms: Api<ConfigMap> = Api::namespaced(client, &ns);
            let owner = create(&cms, json!({"metadata": {"name": "owner"}})).await?;
            create(
                &cms,
                json!({"metadata": {"name": "dependent", "ownerReferences": [{
                "apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.uid()}]}}),
            )
            .await?;
            cms.delete("owner", &DeleteParams::background()).await?;
            wait_for("the dependent to be collected", T, || async {
                match cms.get_opt("dependent").await? {
                    None => Ok(()),
                    Some(_) => Err(anyhow!("dependent still exists")),
                }
            })
            .await
        })
        .await;
}

async fn can_get_pods(client: Client, ns: &str) -> Result<(), kube::Error> {
    Api::<Pod>::namespaced(client, ns)
        .list(&Default::default())
        .await
        .map(|_| ())
}

#[tokio::test]
async fn service_account_tokens_are_bound_by_rbac() {
    shared()
        .in_namespace("rbac", |client, ns| async move {
            let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), &ns);
            create(&sas, json!({"metadata": {"name": "reader"}})).await?;
            let tr: TokenRequest =
                serde_json::from_value(json!({"spec": {"audiences": [], "expirationSeconds": 3600}}))?;
            let tr = sas
                .create_token_request("reader", &PostParams::default(), &tr)
                .await?;
            let token = tr.status.context("token request has no status")?.token;
            let sa_client = Client::try_from(shared().config_with_token(&token).await?)?;

            match can_get_pods(sa_client.clone(), &ns).await {
                Err(kube::Error::Api(s)) if s.code == 403 => {}
                other => bail!("expected 403 without RBAC, got {other:?}"),
            }
            create(
                &Api::<Role>::namespaced(client.clone(), &ns),
                json!({"metadata": {"name": "pod-reader"},
                "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}]}),
            )
            .await?;
            create(
                &Api::<RoleBinding>::namespaced(client.clone(), &ns),
                json!({"metadata": {"name": "pod-reader"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-reader"},
                "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": ns}]}),
            )
            .await?;
            // RBAC is served from an informer cache, so the grant applies within moments.
            wait_for("the Role to take effect", T, || {
                can_get_pods(sa_client.clone(), &ns)
            })
            .await
        })
        .await;
}

#[tokio::test]
async fn a_second_control_plane_runs_beside_the_first_and_stops_on_drop() {
    let cp = ControlPlane::start(Options {
        nodes: 1,
        ..Options::default()
    })
    .await
    .expect("second control plane");
    let pids = cp.pids();
    let client = cp.client().await.unwrap();
    let v = client.apiserver_version().await.unwrap();
    assert_eq!(v.git_version, opkit_testenv::Versions::pinned().kubernetes);
    // The shared one keeps working next to it.
    let shared_client = shared().client().await.unwrap();
    shared_client.apiserver_version().await.unwrap();
    let dir = cp.dir().to_path_buf();
    drop(cp);
    for (name, pid) in pids {
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists() || is_zombie(pid),
            "{name} ({pid}) still running"
        );
    }
    assert!(
        !dir.exists(),
        "temporary state dir {} should be removed",
        dir.display()
    );
}

fn is_zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| s.contains(") Z "))
        .unwrap_or(true)
}
