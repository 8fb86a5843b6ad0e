//! The real node: containerd, a kubelet and kube-proxy on this machine, beside the kwok fakes.
//!
//! kwok marks Pods Running without running anything. What depends on a real container (logs,
//! exit codes, probes, Services, the operator as a Pod) needs this node. It is tainted and
//! labelled so ordinary Pods stay on kwok; a namespace opts in with [`NAMESPACE_ANNOTATIONS`]
//! (the apiserver's `PodNodeSelector` and `PodTolerationRestriction` admission plugins put every
//! Pod of the namespace on this node).
//!
//! One real node runs per machine at a time (containerd's cgroups, iptables and network
//! namespaces are machine-wide); a lock file says so with the owner's pid.
use std::fs::File;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::process::free_port;
use crate::{Error, Result};

/// The real node's name.
pub const NODE_NAME: &str = "opkit-real-node";
/// Label on the real node (and the node selector a namespace opts in with).
pub const NODE_LABEL: (&str, &str) = ("opkit.dev/node", "real");
/// Taint that keeps Pods off the real node unless their namespace opts in.
pub const TAINT_KEY: &str = "opkit.dev/real-node";
/// Pods get addresses from this range on the node's bridge.
pub const POD_CIDR: &str = "10.244.0.0/16";
/// Annotations that put every Pod of a namespace on the real node.
pub const NAMESPACE_ANNOTATIONS: [(&str, &str); 2] = [
    (
        "scheduler.alpha.kubernetes.io/node-selector",
        "opkit.dev/node=real",
    ),
    (
        "scheduler.alpha.kubernetes.io/defaultTolerations",
        r#"[{"key":"opkit.dev/real-node","operator":"Exists","effect":"NoSchedule"}]"#,
    ),
];
/// [`NAMESPACE_ANNOTATIONS`] as a namespace's `metadata.annotations`.
pub fn namespace_annotations() -> std::collections::BTreeMap<String, String> {
    NAMESPACE_ANNOTATIONS
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// The cgroup every Pod of the real node lives under (so cleaning up touches nothing else).
const CGROUP_ROOT: &str = "opkit-testenv";
const LOCK: &str = "/run/opkit-testenv-real-node.lock";
const BRIDGE: &str = "opkit0";

/// Environment variable that turns the real node on (`1`).
pub const ENV: &str = "OPKIT_TESTENV_REAL_NODE";

/// Whether the environment asks for the real node.
pub fn requested() -> bool {
    std::env::var(ENV).is_ok_and(|v| v == "1" || v == "true")
}

/// The address Pods reach the host (and so the apiserver) on: the source address of the
/// default route. No packet is sent.
pub(crate) fn host_ip() -> Result<IpAddr> {
    let s = std::net::UdpSocket::bind("0.0.0.0:0")?;
    s.connect("192.0.2.255:9")
        .or_else(|_| s.connect("10.255.255.255:9"))
        .map_err(|e| {
            Error::Setup(format!(
                "the real node needs a non-loopback address (no route): {e}"
            ))
        })?;
    let ip = s.local_addr()?.ip();
    if ip.is_loopback() || ip.is_unspecified() {
        return Err(Error::Setup(format!(
            "the real node needs a non-loopback address, found {ip}"
        )));
    }
    Ok(ip)
}

/// Holds the machine-wide real-node lock for as long as it lives.
#[derive(Debug)]
pub(crate) struct Lock(#[allow(dead_code)] nix::fcntl::Flock<File>);

/// Takes the real-node lock, waiting up to a minute (the previous node's clean-up holds it
/// briefly), or says who holds it.
pub(crate) fn lock() -> Result<Lock> {
    use std::io::Write;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(LOCK)?;
    let mut f = loop {
        match nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock) {
            Ok(f) => break f,
            Err((back, _)) if std::time::Instant::now() < deadline => {
                file = back;
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            Err(_) => {
                let owner = std::fs::read_to_string(LOCK).unwrap_or_default();
                return Err(Error::Setup(format!(
                    "another real node is running on this machine (pid {}); stop it first (make testenv-down)",
                    owner.trim()
                )));
            }
        }
    };
    f.set_len(0)?;
    write!(f, "{}", std::process::id())?;
    Ok(Lock(f))
}

/// Checks what the node needs and installs what is missing (Debian packages, as root), then
/// returns the directory of the image archives to load.
pub(crate) fn prepare() -> Result<PathBuf> {
    if !nix::unistd::Uid::effective().is_root() {
        return Err(Error::Setup(
            "the real node runs containerd and a kubelet: it needs root".into(),
        ));
    }
    let script = script();
    let out = Command::new("bash")
        .arg(&script)
        .arg("images")
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| Error::Setup(format!("running {}: {e}", script.display())))?;
    if !out.status.success() {
        return Err(Error::Setup(format!("{} images failed", script.display())));
    }
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

fn write_sysctl(key: &str, value: &str) -> Result<()> {
    let path = format!("/proc/sys/{}", key.replace('.', "/"));
    std::fs::write(&path, value).map_err(|e| Error::Setup(format!("setting {key}={value}: {e}")))
}

/// Kernel settings and cgroups the kubelet and kube-proxy expect.
pub(crate) fn host_setup() -> Result<()> {
    write_sysctl("net.ipv4.ip_forward", "1")?;
    // Traffic between two Pods on the bridge passes iptables, so Services between Pods work.
    if Path::new("/proc/sys/net/bridge/bridge-nf-call-iptables").exists() {
        write_sysctl("net.bridge.bridge-nf-call-iptables", "1")?;
    }
    if Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
        std::fs::create_dir_all(Path::new("/sys/fs/cgroup").join(CGROUP_ROOT))?;
        return Ok(());
    }
    // cgroup v1: the kubelet's root must exist in every hierarchy; a new cpuset starts empty.
    let Ok(entries) = std::fs::read_dir("/sys/fs/cgroup") else {
        return Ok(());
    };
    for e in entries.flatten() {
        let h = e.path();
        if !h.is_dir() {
            continue;
        }
        let root = h.join(CGROUP_ROOT);
        std::fs::create_dir_all(&root)?;
        for f in ["cpuset.cpus", "cpuset.mems"] {
            if let Ok(v) = std::fs::read_to_string(h.join(f)) {
                std::fs::write(root.join(f), v.trim())?;
            }
        }
    }
    Ok(())
}

/// Files and arguments of the node's three processes.
pub(crate) struct Plan {
    /// containerd's arguments.
    pub(crate) containerd: Vec<String>,
    /// The kubelet's arguments.
    pub(crate) kubelet: Vec<String>,
    /// kube-proxy's arguments.
    pub(crate) kube_proxy: Vec<String>,
    /// containerd's socket (for `ctr` and cleaning up).
    pub(crate) socket: PathBuf,
}

/// Writes the configuration of containerd, the CNI bridge, the kubelet and kube-proxy into
/// `dir/node` and returns how to start them.
pub(crate) fn configure(
    dir: &Path,
    server: &str,
    ip: IpAddr,
    admin_kubeconfig: &Path,
    registry: &str,
) -> Result<Plan> {
    let node = dir.join("node");
    let p = |f: &str| node.join(f).display().to_string();
    for d in ["cni", "containerd", "kubelet", "pod-logs", "ipam"] {
        std::fs::create_dir_all(node.join(d))?;
    }
    // The local registry speaks plain HTTP: containerd is told so for that host only.
    let hosts = node.join("registry-hosts").join(registry);
    std::fs::create_dir_all(&hosts)?;
    std::fs::write(
        hosts.join("hosts.toml"),
        format!(
            "server = \"http://{registry}\"\n\n[host.\"http://{registry}\"]\n  capabilities = [\"pull\", \"resolve\"]\n"
        ),
    )?;
    let socket = node.join("containerd.sock");
    std::fs::write(
        node.join("cni/10-opkit.conflist"),
        serde_json::json!({
            "cniVersion": "1.0.0",
            "name": "opkit",
            "plugins": [
                {"type": "bridge", "bridge": BRIDGE, "isGateway": true, "ipMasq": true, "hairpinMode": true,
                 "ipam": {"type": "host-local", "dataDir": p("ipam"), "ranges": [[{"subnet": POD_CIDR}]],
                          "routes": [{"dst": "0.0.0.0/0"}]}},
                {"type": "portmap", "capabilities": {"portMappings": true}}
            ]
        })
        .to_string(),
    )?;
    std::fs::write(
        node.join("containerd.toml"),
        format!(
            r#"version = 2
root = "{root}"
state = "{state}"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.internal.v1.tracing"]
[grpc]
  address = "{socket}"
[ttrpc]
  address = "{socket}.ttrpc"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "registry.k8s.io/pause:3.10"
  enable_selinux = false
  # Pods' network namespaces under the state directory, so cleaning up finds them.
  netns_mounts_under_state_dir = true
  # Where the test runs without CAP_SYS_RESOURCE (in a container), a Pod's negative
  # oom_score_adj is refused; never ask for less than containerd's own.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{cni}"
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "{hosts}"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "{runc}"
"#,
            root = p("containerd/root"),
            state = p("containerd/state"),
            socket = socket.display(),
            cni = p("cni"),
            hosts = p("registry-hosts"),
            runc = p("containerd/runc"),
        ),
    )?;
    std::fs::write(
        node.join("kubelet.kubeconfig"),
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: local\n  cluster:\n    server: {server}\n    certificate-authority: {ca}\nusers:\n- name: kubelet\n  user:\n    client-certificate: {cert}\n    client-key: {key}\ncontexts:\n- name: local\n  context: {{cluster: local, user: kubelet}}\ncurrent-context: local\n",
            ca = dir.join(crate::pki::CA_CERT).display(),
            cert = dir.join(crate::pki::KUBELET_CERT).display(),
            key = dir.join(crate::pki::KUBELET_KEY).display(),
        ),
    )?;
    let kubelet_port = free_port()?;
    std::fs::write(
        node.join("kubelet.yaml"),
        format!(
            r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: /{CGROUP_ROOT}
containerRuntimeEndpoint: unix://{socket}
address: {ip}
port: {kubelet_port}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: {healthz}
authentication:
  anonymous: {{enabled: false}}
  webhook: {{enabled: false}}
  x509: {{clientCAFile: {ca}}}
authorization: {{mode: AlwaysAllow}}
failSwapOn: false
podLogsDir: {logs}
registerWithTaints:
- {{key: {TAINT_KEY}, value: "true", effect: NoSchedule}}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {{memory.available: 50Mi, nodefs.available: 1%, imagefs.available: 1%, nodefs.inodesFree: 1%}}
resolvConf: /etc/resolv.conf
serializeImagePulls: false
"#,
            socket = socket.display(),
            healthz = free_port()?,
            ca = dir.join(crate::pki::CA_CERT).display(),
            logs = p("pod-logs"),
        ),
    )?;
    std::fs::write(
        node.join("kube-proxy.yaml"),
        format!(
            r#"apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {{kubeconfig: {kc}}}
mode: iptables
clusterCIDR: {POD_CIDR}
hostnameOverride: {NODE_NAME}
healthzBindAddress: 127.0.0.1:{h}
metricsBindAddress: 127.0.0.1:{m}
conntrack: {{maxPerCore: 0}}
"#,
            kc = admin_kubeconfig.display(),
            h = free_port()?,
            m = free_port()?,
        ),
    )?;
    Ok(Plan {
        containerd: vec![format!("--config={}", p("containerd.toml"))],
        kubelet: vec![
            format!("--config={}", p("kubelet.yaml")),
            format!("--kubeconfig={}", p("kubelet.kubeconfig")),
            format!("--root-dir={}", p("kubelet")),
            format!("--cert-dir={}", p("kubelet/pki")),
            format!("--hostname-override={NODE_NAME}"),
            format!("--node-ip={ip}"),
            format!("--node-labels={}={}", NODE_LABEL.0, NODE_LABEL.1),
            "--v=1".into(),
        ],
        kube_proxy: vec![format!("--config={}", p("kube-proxy.yaml")), "--v=1".into()],
        socket,
    })
}

/// Loads every image archive of `images` into containerd's Kubernetes namespace.
pub(crate) fn load_images(socket: &Path, images: &Path) -> Result<()> {
    for e in std::fs::read_dir(images)?.flatten() {
        if e.path().extension().is_some_and(|x| x == "tar") {
            load_image(socket, &e.path())?;
        }
    }
    Ok(())
}

/// Loads one image archive (`docker save` / `podman save` format) into the node.
pub fn load_image(socket: &Path, archive: &Path) -> Result<()> {
    let out = Command::new("ctr")
        .arg("--address")
        .arg(socket)
        .args(["-n", "k8s.io", "images", "import"])
        .arg(archive)
        .output()
        .map_err(|e| Error::Setup(format!("running ctr: {e}")))?;
    if !out.status.success() {
        return Err(Error::Setup(format!(
            "loading {} into the node: {}",
            archive.display(),
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    Ok(())
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/real-node.sh")
}

/// Stops what a real node leaves once its processes are gone: its containers (every process in
/// its cgroup), containerd's shims, mounts under `dir` and kube-proxy's iptables rules; with
/// `remove`, deletes `dir`. Without `dir`, what any killed testenv node left (run before a
/// node starts).
pub(crate) fn clean_up(dir: Option<&Path>, kube_proxy: &Path, remove: bool) {
    let mut c = Command::new("bash");
    c.arg(script()).arg("clean");
    if remove {
        c.arg("--remove");
    }
    c.arg(dir.map(|d| d.display().to_string()).unwrap_or_default())
        .arg(kube_proxy);
    if let Err(e) = c.status() {
        tracing::warn!("cleaning up the real node: {e}");
    }
}

/// Starts a detached process that cleans up after this one (see [`clean_up`]) once it has
/// exited, however it exits: a test binary's shared control plane is never dropped, and the
/// kernel stops containerd and the kubelet with it but not the containers.
pub(crate) fn reap_after_exit(dir: &Path, kube_proxy: &Path, remove: bool) -> Result<()> {
    use std::os::unix::process::CommandExt;
    let mut c = Command::new("bash");
    c.arg(script()).arg("reap").arg(std::process::id().to_string());
    if remove {
        c.arg("--remove");
    }
    c.arg(dir)
        .arg(kube_proxy)
        .process_group(0)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    c.spawn()
        .map_err(|e| Error::Setup(format!("starting the real node's reaper: {e}")))?;
    Ok(())
}
