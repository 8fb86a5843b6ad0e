//! Shared by the tests that run the `opkit` binary: kubectl, CRD install, processes, the
//! apiserver's audit log.
#![allow(dead_code)]
use std::process::{Child, Command, Stdio};

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, anyhow, ensure};
use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::ServiceAccount;
use kube::Api;
use kube::api::PostParams;
use opkit_testenv::{shared, wait_for};

/// Removes a build tree a test made for itself (a cross build, a generated project's) once the
/// test has passed, where `OPKIT_TEST_DISCARD_BUILDS` is set: on a CI machine whose disk cannot
/// hold every such tree at once. Elsewhere the tree stays, for the next run's build.
pub fn discard_build(dir: &Path) {
    if std::env::var_os("OPKIT_TEST_DISCARD_BUILDS").is_some() && dir.exists() {
        match std::fs::remove_dir_all(dir) {
            Ok(()) => eprintln!("removed the build tree {}", dir.display()),
            Err(e) => eprintln!("could not remove the build tree {}: {e}", dir.display()),
        }
    }
}

/// Runs the pinned kubectl against the local control plane; its stdout, or an error with
/// its stderr.
pub fn kubectl(args: &[&str]) -> anyhow::Result<String> {
    run_kubectl(shared().kubectl(), args)
}

/// Runs `kubectl` (a kubectl command pointed at its cluster) with `args`; its stdout, or an
/// error with its stderr.
pub fn run_kubectl(mut kubectl: Command, args: &[&str]) -> anyhow::Result<String> {
    let out = kubectl.args(args).output()?;
    ensure!(
        out.status.success(),
        "kubectl {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?)
}

/// Runs kubectl with `input` on stdin: (succeeded, stdout + stderr).
pub fn kubectl_stdin(args: &[&str], input: &[u8]) -> anyhow::Result<(bool, String)> {
    run_kubectl_stdin(shared().kubectl(), args, input)
}

/// Runs `kubectl` (a kubectl command pointed at its cluster) with `args` and `input` on stdin:
/// (succeeded, stdout + stderr).
pub fn run_kubectl_stdin(
    mut kubectl: Command,
    args: &[&str],
    input: &[u8],
) -> anyhow::Result<(bool, String)> {
    let mut c = kubectl
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    std::io::Write::write_all(c.stdin.as_mut().context("stdin")?, input)?;
    Ok(outcome(&c.wait_with_output()?))
}

/// Whether a finished command succeeded, and its stdout followed by its stderr.
pub fn outcome(out: &std::process::Output) -> (bool, String) {
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// `opkit crd | kubectl apply --server-side -f -`, as `make install` does.
pub fn install_crds() -> anyhow::Result<()> {
    let crds = Command::new(env!("CARGO_BIN_EXE_opkit")).arg("crd").output()?;
    ensure!(crds.status.success(), "opkit crd failed");
    let (ok, out) = kubectl_stdin(&["apply", "--server-side", "-f", "-"], &crds.stdout)?;
    ensure!(ok, "installing the CRDs failed: {out}");
    Ok(())
}

/// `opkit <args>` against the local control plane.
pub fn opkit(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_opkit"));
    c.args(args).env("KUBECONFIG", shared().kubeconfig());
    c
}

/// A child process killed on drop.
pub struct Running(pub Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Sends SIGTERM, as the kubelet does on a Pod's deletion.
pub fn sigterm(pid: u32) {
    let _ = Command::new("kill").args(["-TERM", &pid.to_string()]).status();
}

/// A loopback port nobody listens on right now (outside the kernel's ephemeral range).
pub fn free_port() -> anyhow::Result<u16> {
    Ok(opkit_testenv::free_port()?)
}

/// What `kubectl get <kind_name> -n ns -o jsonpath=<path>` prints.
pub fn jsonpath(kind_name: &[&str], ns: &str, path: &str) -> anyhow::Result<String> {
    let mut args = vec!["get"];
    args.extend_from_slice(kind_name);
    let path = format!("jsonpath={path}");
    args.extend(["-n", ns, "-o", &path]);
    kubectl(&args)
}

/// Waits until `kubectl get <kind_name> -n ns -o jsonpath=<path>` prints `want`.
pub async fn jsonpath_is(kind_name: &[&str], ns: &str, path: &str, want: &str) -> anyhow::Result<()> {
    wait_for(
        &format!("{} {path} = {want}", kind_name.join(" ")),
        Duration::from_secs(60),
        || async {
            let got = jsonpath(kind_name, ns, path)?;
            if got == want {
                Ok(())
            } else {
                Err(anyhow!("{got:?}"))
            }
        },
    )
    .await
}

/// A one-hour token of ServiceAccount `namespace/name`.
pub async fn service_account_token(
    client: &kube::Client,
    namespace: &str,
    name: &str,
) -> anyhow::Result<String> {
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
    let tr: TokenRequest =
        serde_json::from_value(serde_json::json!({"spec": {"audiences": [], "expirationSeconds": 3600}}))?;
    Ok(sas
        .create_token_request(name, &PostParams::default(), &tr)
        .await?
        .status
        .context("no token")?
        .token)
}

/// A kubeconfig that authenticates as ServiceAccount `namespace/name` (a one-hour token), so
/// that only the RBAC granted to it applies.
pub async fn service_account_kubeconfig(
    client: &kube::Client,
    namespace: &str,
    name: &str,
) -> anyhow::Result<PathBuf> {
    let token = service_account_token(client, namespace, name).await?;
    let path = std::env::temp_dir().join(format!(
        "opkit-{namespace}-{name}-{}.kubeconfig",
        std::process::id()
    ));
    std::fs::write(&path, shared().kubeconfig_with_token(&token)?)?;
    Ok(path)
}

/// Installs the operator's CRDs (`opkit crd`) on `cp` with a server-side apply.
pub fn install_crds_on(cp: &opkit_testenv::ControlPlane) -> anyhow::Result<()> {
    let crds = Command::new(env!("CARGO_BIN_EXE_opkit")).arg("crd").output()?;
    let mut apply = Command::new(cp.binaries().path("kubectl"))
        .args(["apply", "--server-side", "-f", "-"])
        .env("KUBECONFIG", cp.kubeconfig_path())
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()?;
    std::io::Write::write_all(apply.stdin.as_mut().context("stdin")?, &crds.stdout)?;
    drop(apply.stdin.take());
    ensure!(apply.wait()?.success(), "installing the CRDs failed");
    Ok(())
}

/// A kubeconfig for a new ServiceAccount `sa` of `ns`, bound to cluster-admin: the admin one
/// with the ServiceAccount's token, so that the audit log tells replicas apart.
pub async fn kubeconfig_for(
    cp: &opkit_testenv::ControlPlane,
    client: &kube::Client,
    ns: &str,
    sa: &str,
) -> anyhow::Result<PathBuf> {
    use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), ns);
    sas.create(
        &PostParams::default(),
        &serde_json::from_value(serde_json::json!({"metadata": {"name": sa}}))?,
    )
    .await?;
    let crbs: Api<ClusterRoleBinding> = Api::all(client.clone());
    crbs.create(
        &PostParams::default(),
        &serde_json::from_value(serde_json::json!({
            "metadata": {"name": format!("{ns}-{sa}")},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
            "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": ns}],
        }))?,
    )
    .await?;
    let token = service_account_token(client, ns, sa).await?;
    let cfg = opkit_testenv::kubeconfig_with_token(&cp.kubeconfig_path(), &token)?;
    let path = cp.dir().join(format!("{sa}.kubeconfig"));
    std::fs::write(&path, cfg)?;
    Ok(path)
}

/// Creates the namespaces `names`, then waits for the first one's default ServiceAccount
/// (objects with Pods are refused until it exists).
pub async fn create_namespaces(client: &kube::Client, names: &[&str]) -> anyhow::Result<()> {
    let nss: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    for ns in names {
        nss.create(
            &PostParams::default(),
            &serde_json::from_value(serde_json::json!({"metadata": {"name": ns}}))?,
        )
        .await?;
    }
    let first = names.first().copied().unwrap_or("default");
    wait_for("the default ServiceAccount", Duration::from_secs(30), || async {
        Api::<ServiceAccount>::namespaced(client.clone(), first)
            .get("default")
            .await
            .map(|_| ())
    })
    .await
}

/// Creates `n` Ats `at-0`..`at-<n-1>` in `ns`, running `echo YAY`, falling due evenly from
/// `first_due` over `spread_s` seconds.
pub async fn create_ats(
    client: &kube::Client,
    ns: &str,
    n: usize,
    first_due: k8s_openapi::jiff::Timestamp,
    spread_s: u64,
) -> anyhow::Result<()> {
    let ats: Api<opkit_api::at::At> = Api::namespaced(client.clone(), ns);
    for i in 0..n {
        let due = first_due
            + k8s_openapi::jiff::SignedDuration::from_millis((spread_s * 1000 * i as u64 / n as u64) as i64);
        ats.create(
            &PostParams::default(),
            &serde_json::from_value(serde_json::json!({
                "apiVersion": "cnat.programming-kubernetes.info/v1alpha1", "kind": "At",
                "metadata": {"name": format!("at-{i}")},
                "spec": {"schedule": due.strftime("%Y-%m-%dT%H:%M:%S%.3fZ").to_string(), "command": "echo YAY"},
            }))?,
        )
        .await?;
    }
    Ok(())
}

/// One request in the apiserver's audit log (a control plane started with `audit_log`).
#[derive(Clone, Debug)]
pub struct Audited {
    pub user: String,
    pub verb: String,
    /// The API group; empty for the core group.
    pub group: String,
    pub resource: String,
    pub subresource: String,
    pub name: String,
    pub code: i64,
    /// The answer's message (for a failure).
    pub message: String,
    /// The authorizer's decision (`allow`, `forbid`).
    pub decision: String,
    pub received: String,
    pub done: String,
    /// A watch that streams its initial list (`sendInitialEvents=true`): a list in effect.
    pub streams_list: bool,
}

/// How many creates of the Pod `pod` in `audit` were answered with `code` (not the
/// scheduler's `pods/binding` of the same name).
pub fn pod_creates(audit: &[Audited], pod: &str, code: i64) -> usize {
    audit
        .iter()
        .filter(|e| {
            e.resource == "pods"
                && e.subresource.is_empty()
                && e.verb == "create"
                && e.code == code
                && e.name == pod
        })
        .count()
}

/// Every answered request in the audit log at `path`. A watch is logged when its answer starts
/// (it may still be open), and again when it ends.
pub fn read_audit(path: &Path) -> anyhow::Result<Vec<Audited>> {
    let text = std::fs::read_to_string(path)?;
    let mut out = Vec::new();
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line)?;
        if v["stage"] != "ResponseComplete" && v["stage"] != "ResponseStarted" {
            continue;
        }
        let s = |p: &str| v.pointer(p).and_then(|x| x.as_str()).unwrap_or("").to_string();
        out.push(Audited {
            user: s("/user/username"),
            verb: s("/verb"),
            group: s("/objectRef/apiGroup"),
            resource: s("/objectRef/resource"),
            subresource: s("/objectRef/subresource"),
            name: s("/objectRef/name"),
            code: v
                .pointer("/responseStatus/code")
                .and_then(|c| c.as_i64())
                .unwrap_or(0),
            message: s("/responseStatus/message"),
            decision: s("/annotations/authorization.k8s.io~1decision"),
            received: s("/requestReceivedTimestamp"),
            done: s("/stageTimestamp"),
            streams_list: s("/requestURI").contains("sendInitialEvents=true"),
        });
    }
    Ok(out)
}

/// A document of the local registry (an image index or manifest) as JSON, over its HTTP API.
pub fn registry_manifest(
    registry: &str,
    repository: &str,
    reference: &str,
) -> anyhow::Result<serde_json::Value> {
    let accept = [
        "application/vnd.oci.image.index.v1+json",
        "application/vnd.docker.distribution.manifest.list.v2+json",
        "application/vnd.oci.image.manifest.v1+json",
        "application/vnd.docker.distribution.manifest.v2+json",
    ]
    .join(",");
    let out = Command::new("curl")
        .args(["-sf", "-H", &format!("Accept: {accept}")])
        .arg(format!("http://{registry}/v2/{repository}/manifests/{reference}"))
        .output()?;
    ensure!(
        out.status.success(),
        "GET {repository}:{reference} from {registry}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// The digest of each platform (`os/architecture`) of an image index.
pub fn index_platforms(index: &serde_json::Value) -> anyhow::Result<Vec<(String, String)>> {
    let manifests = index["manifests"]
        .as_array()
        .with_context(|| format!("not an image index: {index}"))?;
    Ok(manifests
        .iter()
        .map(|m| {
            (
                format!(
                    "{}/{}",
                    m["platform"]["os"].as_str().unwrap_or_default(),
                    m["platform"]["architecture"].as_str().unwrap_or_default()
                ),
                m["digest"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect())
}
