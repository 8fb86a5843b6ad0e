//! Starts and stops one local control plane on loopback.
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, ServiceAccount};
use kube::api::{Api, ObjectMeta, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

use crate::binaries::Binaries;
use crate::node;
use crate::pki;
use crate::process::{Component, free_port};
use crate::{Error, Result};

const STAGES_NODE: &str = include_str!("../stages/node.yaml");
const STAGES_POD: &str = include_str!("../stages/pod.yaml");

/// How to start a control plane.
#[derive(Debug, Clone)]
pub struct Options {
    /// Keep state here (and leave it on stop) instead of a fresh temporary directory.
    pub state_dir: Option<PathBuf>,
    /// How many kwok fake nodes to create.
    pub nodes: usize,
    /// Write an apiserver audit log (`audit.log`, metadata level, every request before its
    /// answer) for request accounting.
    pub audit_log: bool,
    /// How long to wait for everything to become ready.
    pub timeout: Duration,
    /// Also run a real node (containerd, kubelet, kube-proxy; see [`crate::node`]) and an
    /// image registry it pulls from. Needs root.
    pub real_node: bool,
    /// With the real node, the registry's port on 127.0.0.1 (a free one when unset).
    pub registry_port: Option<u16>,
    /// More kube-apiserver flags, after the defaults (a later flag wins): to test against a
    /// server with a feature gate off, say.
    pub apiserver_flags: Vec<String>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            state_dir: None,
            nodes: 2,
            audit_log: false,
            timeout: Duration::from_secs(90),
            real_node: false,
            registry_port: None,
            apiserver_flags: Vec::new(),
        }
    }
}

/// A running control plane. Dropping it stops every component (and removes a temporary state
/// directory).
pub struct ControlPlane {
    dir: PathBuf,
    remove_dir: bool,
    binaries: Binaries,
    server: String,
    etcd: String,
    components: Vec<Component>,
    node: Option<RealNode>,
    registry: Option<String>,
    /// The controller-manager's secure port (its `/metrics`).
    controller_manager: u16,
}

/// What a running real node needs for stopping and for loading images.
#[derive(Debug)]
struct RealNode {
    images: PathBuf,
    socket: PathBuf,
    _lock: node::Lock,
}

impl std::fmt::Debug for ControlPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlPlane")
            .field("dir", &self.dir)
            .field("server", &self.server)
            .finish()
    }
}

/// File name of the admin kubeconfig inside the state directory.
pub const KUBECONFIG: &str = "kubeconfig";

fn temp_root() -> PathBuf {
    std::env::temp_dir().join("opkit-testenv")
}

/// Removes temporary state directories left behind by processes that no longer exist.
fn reap_stale_dirs() {
    let Ok(entries) = std::fs::read_dir(temp_root()) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let pid = name
            .strip_prefix("run-")
            .and_then(|r| r.split('-').next())
            .and_then(|p| p.parse::<u32>().ok());
        if let Some(pid) = pid
            && !Path::new(&format!("/proc/{pid}")).exists()
        {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

fn random_token() -> Result<String> {
    use std::io::Read;
    let mut buf = [0u8; 16];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut buf)?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

impl ControlPlane {
    /// Starts etcd, the apiserver, controller-manager, scheduler and kwok with fake nodes, and
    /// waits until the apiserver is ready, the nodes are Ready and the `default` ServiceAccount
    /// exists.
    pub async fn start(opts: Options) -> Result<ControlPlane> {
        let binaries = Binaries::ensure()?;
        let (dir, remove_dir) = match &opts.state_dir {
            Some(d) => (d.clone(), false),
            None => {
                static N: AtomicUsize = AtomicUsize::new(0);
                reap_stale_dirs();
                let d = temp_root().join(format!(
                    "run-{}-{}",
                    std::process::id(),
                    N.fetch_add(1, Ordering::SeqCst)
                ));
                (d, true)
            }
        };
        if dir.exists() {
            std::fs::remove_dir_all(&dir)?;
        }
        std::fs::create_dir_all(&dir)?;
        let node = if opts.real_node {
            let lock = node::lock()?;
            let images = node::prepare()?;
            node::clean_up(None, &binaries.path("kube-proxy"), false);
            node::host_setup()?;
            node::reap_after_exit(&dir, &binaries.path("kube-proxy"), remove_dir)?;
            Some(RealNode {
                images,
                socket: PathBuf::new(),
                _lock: lock,
            })
        } else {
            None
        };
        let mut cp = ControlPlane {
            dir,
            remove_dir,
            binaries,
            server: String::new(),
            etcd: String::new(),
            components: Vec::new(),
            node,
            registry: None,
            controller_manager: 0,
        };
        let deadline = Instant::now() + opts.timeout;
        // A port found free can still be taken before the component binds it (by another
        // control plane booting at the same moment): start again on fresh ports.
        let mut attempts = 0;
        loop {
            attempts += 1;
            match cp.boot(&opts, deadline).await {
                Ok(()) => return Ok(cp),
                Err(e) if attempts < 3 && e.to_string().contains("address already in use") => {
                    tracing::warn!("control plane start lost a port race, starting again: {e}");
                    cp.stop_components();
                    std::fs::remove_dir_all(&cp.dir)?;
                    std::fs::create_dir_all(&cp.dir)?;
                }
                Err(e) => return Err(e),
            }
        }
    }

    async fn boot(&mut self, opts: &Options, deadline: Instant) -> Result<()> {
        let dir = self.dir.clone();
        let node_ip = match opts.real_node {
            true => Some(node::host_ip()?),
            false => None,
        };
        let identity = node_ip.map(|ip| pki::NodeIdentity {
            name: node::NODE_NAME,
            ip,
        });
        pki::write(&dir, identity.as_ref())?;
        let token = random_token()?;
        std::fs::write(
            dir.join("tokens.csv"),
            format!("{token},admin,admin,\"system:masters\"\n"),
        )?;
        let p = |f: &str| dir.join(f).display().to_string();

        // etcd
        let (etcd_client, etcd_peer) = (free_port()?, free_port()?);
        self.etcd = format!("127.0.0.1:{etcd_client}");
        self.launch(
            "etcd",
            vec![
                "--name=testenv".into(),
                format!("--data-dir={}", p("etcd-data")),
                format!("--listen-client-urls=http://127.0.0.1:{etcd_client}"),
                format!("--advertise-client-urls=http://127.0.0.1:{etcd_client}"),
                format!("--listen-peer-urls=http://127.0.0.1:{etcd_peer}"),
                format!("--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}"),
                format!("--initial-cluster=testenv=http://127.0.0.1:{etcd_peer}"),
                "--unsafe-no-fsync".into(),
                "--log-level=warn".into(),
            ],
        )?;

        // kube-apiserver
        let port = free_port()?;
        self.server = format!("https://127.0.0.1:{port}");
        let mut args = vec![
            format!("--etcd-servers=http://127.0.0.1:{etcd_client}"),
            format!("--secure-port={port}"),
            format!("--cert-dir={}", p("apiserver-certs")),
            format!("--tls-cert-file={}", p(pki::SERVING_CERT)),
            format!("--tls-private-key-file={}", p(pki::SERVING_KEY)),
            format!("--client-ca-file={}", p(pki::CA_CERT)),
            format!("--token-auth-file={}", p("tokens.csv")),
            "--authorization-mode=Node,RBAC".into(),
            format!("--service-account-key-file={}", p(pki::SA_PUB)),
            format!("--service-account-signing-key-file={}", p(pki::SA_KEY)),
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
            "--service-cluster-ip-range=10.96.0.0/16".into(),
            // Namespaces opt into the real node with annotations (see `node`).
            "--enable-admission-plugins=PodNodeSelector,PodTolerationRestriction".into(),
            "--allow-privileged=true".into(),
            "--enable-priority-and-fairness=false".into(),
            "--v=0".into(),
        ];
        match node_ip {
            // Pods reach the apiserver through the `kubernetes` Service: its endpoint must be
            // an address they can route to, so the apiserver listens beyond loopback.
            Some(ip) => args.extend([
                "--bind-address=0.0.0.0".into(),
                format!("--advertise-address={ip}"),
                "--endpoint-reconciler-type=lease".into(),
                // The node's name does not resolve: `kubectl logs` dials its address.
                "--kubelet-preferred-address-types=InternalIP".into(),
                format!("--kubelet-client-certificate={}", p(pki::APISERVER_KUBELET_CERT)),
                format!("--kubelet-client-key={}", p(pki::APISERVER_KUBELET_KEY)),
            ]),
            None => args.extend([
                "--bind-address=127.0.0.1".into(),
                "--advertise-address=127.0.0.1".into(),
                "--endpoint-reconciler-type=none".into(),
            ]),
        }
        if opts.audit_log {
            std::fs::write(
                dir.join("audit-policy.yaml"),
                "apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\nrules:\n- level: Metadata\n",
            )?;
            args.push(format!("--audit-policy-file={}", p("audit-policy.yaml")));
            args.push(format!("--audit-log-path={}", p("audit.log")));
            args.push("--audit-log-format=json".into());
            // Blocking: every request is in the file before it is answered. The batch mode
            // drops its buffer when the apiserver restarts ("audit backend shut down"), and
            // the chaos test counts each At's Pod creates from this log.
            args.push("--audit-log-mode=blocking".into());
            // No rotation (the default rotates at 100 MB, which a large benchmark exceeds).
            args.push("--audit-log-maxsize=1000000".into());
        }
        args.extend(opts.apiserver_flags.iter().cloned());
        self.launch("kube-apiserver", args)?;

        let kubeconfig = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: opkit-testenv\n  cluster:\n    server: {server}\n    certificate-authority: {ca}\nusers:\n- name: admin\n  user:\n    token: {token}\ncontexts:\n- name: opkit-testenv\n  context:\n    cluster: opkit-testenv\n    user: admin\n    namespace: default\ncurrent-context: opkit-testenv\n",
            server = self.server,
            ca = p(pki::CA_CERT),
        );
        std::fs::write(dir.join(KUBECONFIG), kubeconfig)?;
        let client = self.client().await?;
        self.wait_ready(deadline).await?;

        let kc = p(KUBECONFIG);
        let common = |port: u16| {
            vec![
                format!("--kubeconfig={kc}"),
                format!("--authentication-kubeconfig={kc}"),
                format!("--authorization-kubeconfig={kc}"),
                "--bind-address=127.0.0.1".to_string(),
                format!("--secure-port={port}"),
                "--leader-elect=false".to_string(),
            ]
        };
        self.controller_manager = free_port()?;
        let mut kcm = common(self.controller_manager);
        kcm.extend([
            format!("--service-account-private-key-file={}", p(pki::SA_KEY)),
            format!("--root-ca-file={}", p(pki::CA_CERT)),
            "--use-service-account-credentials=false".into(),
            "--kube-api-qps=200".into(),
            "--kube-api-burst=400".into(),
            "--concurrent-deployment-syncs=10".into(),
            "--concurrent-replicaset-syncs=10".into(),
            "--concurrent-gc-syncs=20".into(),
        ]);
        self.launch("kube-controller-manager", kcm)?;
        let mut scheduler = common(free_port()?);
        // Pods of large tests and the benchmark are bound by the scheduler: don't let its
        // client-side rate limit be the bottleneck.
        scheduler.extend(["--kube-api-qps=200".into(), "--kube-api-burst=400".into()]);
        self.launch("kube-scheduler", scheduler)?;

        let stages = dir.join("kwok-stages.yaml");
        std::fs::write(&stages, format!("{STAGES_NODE}\n---\n{STAGES_POD}"))?;
        self.launch(
            "kwok",
            vec![
                format!("--kubeconfig={kc}"),
                format!("--config={}", stages.display()),
                // Only the fake nodes: the real node has a kubelet.
                "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake".into(),
                format!("--server-address=127.0.0.1:{}", free_port()?),
                "--node-lease-duration-seconds=40".into(),
            ],
        )?;

        let nodes: Api<Node> = Api::all(client.clone());
        for i in 0..opts.nodes {
            let name = format!("kwok-node-{i}");
            let node = Node {
                metadata: ObjectMeta {
                    name: Some(name.clone()),
                    annotations: Some([("kwok.x-k8s.io/node".to_string(), "fake".to_string())].into()),
                    labels: Some(
                        [
                            ("kubernetes.io/hostname".to_string(), name.clone()),
                            ("kubernetes.io/os".to_string(), "linux".to_string()),
                            ("type".to_string(), "kwok".to_string()),
                        ]
                        .into(),
                    ),
                    ..Default::default()
                },
                ..Default::default()
            };
            match nodes.create(&PostParams::default(), &node).await {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 409 => {}
                Err(e) => return Err(e.into()),
            }
        }
        let want = opts.nodes;
        self.wait("kwok", deadline, "fake nodes to become Ready", || {
            let nodes = nodes.clone();
            async move {
                let list = nodes.list(&Default::default()).await.ok()?;
                let ready = list
                    .items
                    .iter()
                    .filter(|n| {
                        n.status
                            .as_ref()
                            .and_then(|s| s.conditions.as_ref())
                            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
                    })
                    .count();
                (ready >= want).then_some(())
            }
        })
        .await?;
        if let Some(ip) = node_ip {
            let port = match opts.registry_port {
                Some(p) => p,
                None => crate::process::free_port()?,
            };
            self.start_registry(port, deadline).await?;
            self.start_real_node(ip, &nodes, deadline).await?;
        }
        let sas: Api<ServiceAccount> = Api::namespaced(client, "default");
        self.wait(
            "kube-controller-manager",
            deadline,
            "the default ServiceAccount",
            || {
                let sas = sas.clone();
                async move { sas.get_opt("default").await.ok().flatten().map(|_| ()) }
            },
        )
        .await?;
        Ok(())
    }

    fn launch(&mut self, name: &str, args: Vec<String>) -> Result<()> {
        let program = match name {
            "containerd" => PathBuf::from("containerd"),
            _ => self.binaries.path(name),
        };
        let c = Component::start(name, &program, &args, &self.dir)?;
        self.components.push(c);
        Ok(())
    }

    /// The image registry on 127.0.0.1:`port`, blobs under the state directory.
    async fn start_registry(&mut self, port: u16, deadline: Instant) -> Result<()> {
        let address = format!("127.0.0.1:{port}");
        let blobs = self.dir.join("registry-blobs");
        self.launch(
            "registry",
            vec![
                format!("-address={address}"),
                format!("-blobs={}", blobs.display()),
            ],
        )?;
        let addr = address.clone();
        self.wait("registry", deadline, "the image registry to listen", || {
            let addr = addr.clone();
            async move { tokio::net::TcpStream::connect(&addr).await.ok().map(|_| ()) }
        })
        .await?;
        self.registry = Some(address);
        Ok(())
    }

    /// The image registry (`127.0.0.1:PORT`, plain HTTP) the real node pulls from: push an
    /// image there and a Pod's `image: 127.0.0.1:PORT/name:tag` runs it.
    pub fn registry(&self) -> Option<&str> {
        self.registry.as_deref()
    }

    /// containerd with the sample images, the kubelet and kube-proxy; waits for the node to be
    /// Ready.
    async fn start_real_node(
        &mut self,
        ip: std::net::IpAddr,
        nodes: &Api<Node>,
        deadline: Instant,
    ) -> Result<()> {
        let registry = self
            .registry
            .clone()
            .ok_or_else(|| Error::Setup("the real node starts after the registry".into()))?;
        let plan = node::configure(&self.dir, &self.server, ip, &self.kubeconfig_path(), &registry)?;
        self.launch("containerd", plan.containerd)?;
        let socket = plan.socket.clone();
        self.wait("containerd", deadline, "containerd's socket", || {
            let socket = socket.clone();
            async move { std::os::unix::net::UnixStream::connect(&socket).ok().map(|_| ()) }
        })
        .await?;
        if let Some(n) = self.node.as_mut() {
            n.socket = plan.socket.clone();
            node::load_images(&n.socket, &n.images)?;
        }
        self.launch("kubelet", plan.kubelet)?;
        self.launch("kube-proxy", plan.kube_proxy)?;
        self.wait("kubelet", deadline, "the real node to become Ready", || {
            let nodes = nodes.clone();
            async move {
                let n = nodes.get_opt(node::NODE_NAME).await.ok()??;
                let ready = n
                    .status?
                    .conditions?
                    .iter()
                    .any(|c| c.type_ == "Ready" && c.status == "True");
                ready.then_some(())
            }
        })
        .await
    }

    /// The real node's containerd socket, if this control plane has a real node.
    pub fn node_socket(&self) -> Option<&Path> {
        self.node.as_ref().map(|n| n.socket.as_path())
    }

    /// Loads an image archive (`docker save` / `podman save` format) into the real node's
    /// containerd, as `kind load image-archive` does: Pods on the node then run it without a
    /// registry.
    pub fn load_image(&self, archive: &Path) -> Result<()> {
        match &self.node {
            Some(n) => node::load_image(&n.socket, archive),
            None => Err(Error::Setup("this control plane has no real node".into())),
        }
    }

    /// Polls `check` until it yields, failing with the named component's log if any component
    /// exits or the deadline passes.
    async fn wait<T, F, Fut>(
        &mut self,
        component: &str,
        deadline: Instant,
        what: &str,
        mut check: F,
    ) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Option<T>>,
    {
        loop {
            self.check_running()?;
            if let Some(v) = check().await {
                return Ok(v);
            }
            if Instant::now() > deadline {
                let c = self.components.iter().find(|c| c.name == component);
                return Err(match c {
                    Some(c) => c.failure(format!("timed out waiting for {what}")),
                    None => Error::Setup(format!("timed out waiting for {what}")),
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Fails with the component's name and log tail if any component has exited.
    pub fn check_running(&mut self) -> Result<()> {
        self.components.iter_mut().try_for_each(|c| c.check_running())
    }

    /// The state directory (logs, certificates, kubeconfig).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The admin kubeconfig file.
    pub fn kubeconfig_path(&self) -> PathBuf {
        self.dir.join(KUBECONFIG)
    }

    /// The apiserver URL.
    pub fn server(&self) -> &str {
        &self.server
    }

    /// The binaries this control plane runs (`kubectl` among them).
    pub fn binaries(&self) -> &Binaries {
        &self.binaries
    }

    /// A kube client config with the admin identity.
    pub async fn config(&self) -> Result<Config> {
        config_from_file(&self.kubeconfig_path()).await
    }

    /// A client with the admin identity (member of `system:masters`).
    pub async fn client(&self) -> Result<Client> {
        Ok(Client::try_from(self.config().await?)?)
    }

    /// A client for the controller-manager's own endpoints (`/metrics`), with the admin token.
    pub async fn controller_manager_client(&self) -> Result<Client> {
        let mut config = self.config().await?;
        config.cluster_url = format!("https://127.0.0.1:{}", self.controller_manager)
            .parse()
            .map_err(|e| Error::Setup(format!("controller-manager url: {e}")))?;
        // Its serving certificate is self-signed.
        config.accept_invalid_certs = true;
        config.root_cert = None;
        Ok(Client::try_from(config)?)
    }

    /// The work the controller-manager's Deployment and ReplicaSet controllers still hold
    /// (queued plus in progress, from its `/metrics`, read with
    /// [`ControlPlane::controller_manager_client`]): a benchmark waits for 0 so that what it
    /// times next is not the controller-manager catching up.
    pub async fn controller_manager_backlog(client: &Client) -> Result<f64> {
        let request = http::Request::get("/metrics")
            .body(Vec::new())
            .map_err(|e| Error::Setup(e.to_string()))?;
        let body = client.request_text(request).await?;
        Ok(backlog(&body, &["deployment", "replicaset"]))
    }

    /// Pids of the components, in start order (for the daemon's status output).
    pub fn pids(&self) -> Vec<(String, u32)> {
        self.components
            .iter()
            .map(|c| (c.name.clone(), c.pid()))
            .collect()
    }
}

/// The sum of `workqueue_depth` and `workqueue_unfinished_work_seconds` of the named queues
/// in a Prometheus text exposition.
fn backlog(metrics: &str, queues: &[&str]) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("workqueue_depth{") || l.starts_with("workqueue_unfinished_work_seconds{"))
        .filter(|l| queues.iter().any(|q| l.contains(&format!("name=\"{q}\""))))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// One JSON request to etcd's HTTP gateway.
async fn etcd_post(
    addr: std::net::SocketAddr,
    path: &str,
    body: &serde_json::Value,
) -> Result<serde_json::Value> {
    let (code, answer) = crate::harness::http_request(addr, "POST", path, Some(&body.to_string())).await?;
    if code != 200 {
        return Err(Error::Setup(format!("etcd {path}: {code} {answer}")));
    }
    serde_json::from_str(&answer).map_err(|e| Error::Setup(format!("etcd {path}: {e}: {answer}")))
}

/// Reads a kubeconfig file into a client config.
pub async fn config_from_file(path: &Path) -> Result<Config> {
    let kc =
        Kubeconfig::read_from(path).map_err(|e| Error::Setup(format!("reading {}: {e}", path.display())))?;
    Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .map_err(|e| Error::Setup(format!("loading {}: {e}", path.display())))
}

/// Fault injection: what a test does to the control plane to prove an operator survives it.
impl ControlPlane {
    fn component(&mut self, name: &str) -> Result<&mut Component> {
        self.components
            .iter_mut()
            .find(|c| c.name == name)
            .ok_or_else(|| Error::Setup(format!("no component {name}")))
    }

    /// Stops a component (`etcd`, `kube-apiserver`, `kube-controller-manager`,
    /// `kube-scheduler`, `kwok`) with SIGTERM and starts it again on the same ports and state;
    /// after the apiserver or etcd, waits until the apiserver answers `/readyz` again.
    pub async fn restart(&mut self, name: &str) -> Result<()> {
        self.component(name)?.restart(Duration::from_secs(10))?;
        if name == "kube-apiserver" || name == "etcd" {
            self.wait_ready(Instant::now() + Duration::from_secs(60)).await?;
        }
        Ok(())
    }

    /// Freezes a component (SIGSTOP): its connections stay open but nothing is answered.
    pub fn pause(&mut self, name: &str) -> Result<()> {
        self.component(name)?.signal(nix::sys::signal::Signal::SIGSTOP)
    }

    /// Lets a paused component run again (SIGCONT).
    pub fn resume(&mut self, name: &str) -> Result<()> {
        self.component(name)?.signal(nix::sys::signal::Signal::SIGCONT)
    }

    /// Compacts etcd's history up to its current revision, so every watch that resumes from
    /// an older resourceVersion gets `410 Gone` and must list again. Returns the revision.
    pub async fn compact_etcd(&self) -> Result<u64> {
        let addr: std::net::SocketAddr = self
            .etcd
            .parse()
            .map_err(|e| Error::Setup(format!("etcd address {}: {e}", self.etcd)))?;
        let revision =
            |v: &serde_json::Value| -> Option<u64> { v.pointer("/header/revision")?.as_str()?.parse().ok() };
        let head = etcd_post(addr, "/v3/kv/range", &serde_json::json!({"key": "AA=="})).await?;
        let rev = revision(&head).ok_or_else(|| Error::Setup(format!("etcd range answered {head}")))?;
        etcd_post(
            addr,
            "/v3/kv/compaction",
            &serde_json::json!({"revision": rev.to_string(), "physical": true}),
        )
        .await?;
        Ok(rev)
    }

    async fn wait_ready(&mut self, deadline: Instant) -> Result<()> {
        let client = self.client().await?;
        self.wait("kube-apiserver", deadline, "/readyz to answer ok", || {
            let client = client.clone();
            async move {
                let req = http::Request::get("/readyz").body(Vec::new()).ok()?;
                client.request_text(req).await.ok().filter(|t| t.trim() == "ok")
            }
        })
        .await
        .map(|_| ())
    }

    /// Stops the components, the last started first, and what a real node leaves behind.
    fn stop_components(&mut self) {
        while let Some(mut c) = self.components.pop() {
            c.stop(Duration::from_secs(5));
        }
        if self.node.is_some() {
            node::clean_up(Some(&self.dir), &self.binaries.path("kube-proxy"), false);
        }
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.stop_components();
        if self.remove_dir {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn backlog_sums_the_named_queues_only() {
        let metrics = "\
# HELP workqueue_depth [STABLE] Current depth of workqueue
workqueue_depth{name=\"deployment\"} 3
workqueue_depth{name=\"replicaset\"} 0
workqueue_depth{name=\"garbage_collector_graph_changes\"} 7
workqueue_unfinished_work_seconds{name=\"deployment\"} 0.25
workqueue_unfinished_work_seconds{name=\"job\"} 9
workqueue_adds_total{name=\"deployment\"} 100
";
        assert_eq!(super::backlog(metrics, &["deployment", "replicaset"]), 3.25);
        assert_eq!(super::backlog(metrics, &["replicaset"]), 0.0);
    }
}
