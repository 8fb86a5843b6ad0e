//! What controller tests use: one shared control plane per test binary, a fresh namespace per
//! test with a dump of its objects when the test fails, and polling with a deadline.
use std::fmt::Display;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use futures::FutureExt;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, DeleteParams, ObjectMeta, PostParams};
use kube::{Client, Config};

use crate::cluster::{ControlPlane, Options, config_from_file};

/// The control plane shared by every test in one test binary.
#[derive(Debug, Clone)]
pub struct Shared {
    kubeconfig: PathBuf,
    kubectl: PathBuf,
    /// The real node's containerd socket, when the cluster has one.
    node_socket: Option<PathBuf>,
    /// The image registry the real node pulls from (`127.0.0.1:PORT`).
    registry: Option<String>,
}

/// Set by [`shared_real_node`] before the shared control plane starts.
static WANT_REAL_NODE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The shared control plane with a real node (see [`crate::node`]), or `None` when
/// `OPKIT_TESTENV_REAL_NODE=1` is not set (the caller then skips, saying so). Every test of a
/// binary that needs the real node calls this first: the binary's control plane gets the node,
/// and every [`Shared::in_namespace`] puts its Pods on it.
pub fn shared_real_node() -> Option<&'static Shared> {
    if !crate::node::requested() {
        eprintln!(
            "skipped: this test needs the real node; run it with {}=1 (as `make test` does)",
            crate::node::ENV
        );
        return None;
    }
    WANT_REAL_NODE.store(true, std::sync::atomic::Ordering::SeqCst);
    let s = shared();
    assert!(
        s.node_socket.is_some(),
        "the shared control plane started without the real node: call shared_real_node() before shared() in this test binary"
    );
    Some(s)
}

/// Returns the shared control plane, starting it on first use.
///
/// When `OPKIT_TESTENV_KUBECONFIG` names a kubeconfig (as `make test` and `make testenv-up`
/// arrange), that cluster is used instead of starting one. A plain `KUBECONFIG` is never used,
/// so tests cannot touch a real cluster by accident.
pub fn shared() -> &'static Shared {
    static SHARED: OnceLock<Result<Shared, String>> = OnceLock::new();
    let r = SHARED.get_or_init(|| {
        if let Ok(kc) = std::env::var("OPKIT_TESTENV_KUBECONFIG") {
            let kubectl = crate::Binaries::ensure()
                .map_err(|e| e.to_string())?
                .path("kubectl");
            let kubeconfig = PathBuf::from(kc);
            // `make testenv-up` with the real node keeps containerd beside the kubeconfig.
            let node_socket = kubeconfig
                .parent()
                .map(|d| d.join("node/containerd.sock"))
                .filter(|s| WANT_REAL_NODE.load(std::sync::atomic::Ordering::SeqCst) && s.exists());
            let registry = kubeconfig
                .parent()
                .and_then(|d| std::fs::read_to_string(d.join("registry-address")).ok())
                .map(|r| r.trim().to_string())
                .filter(|_| node_socket.is_some());
            return Ok(Shared {
                kubeconfig,
                kubectl,
                node_socket,
                registry,
            });
        }
        let (tx, rx) = std::sync::mpsc::channel();
        // The control plane lives on its own thread and runtime for the whole test binary; its
        // processes die with the test process (see `process`).
        std::thread::Builder::new()
            .name("testenv-shared".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = tx.send(Err(e.to_string()));
                        return;
                    }
                };
                let opts = Options {
                    real_node: WANT_REAL_NODE.load(std::sync::atomic::Ordering::SeqCst),
                    ..Options::default()
                };
                match rt.block_on(ControlPlane::start(opts)) {
                    Ok(cp) => {
                        let _ = tx.send(Ok(Shared {
                            kubeconfig: cp.kubeconfig_path(),
                            kubectl: cp.binaries().path("kubectl"),
                            node_socket: cp.node_socket().map(Path::to_path_buf),
                            registry: cp.registry().map(String::from),
                        }));
                        let _keep = cp;
                        loop {
                            std::thread::park();
                        }
                    }
                    Err(e) => {
                        let _ = tx.send(Err(e.to_string()));
                    }
                }
            })
            .map_err(|e| e.to_string())?;
        rx.recv().map_err(|e| e.to_string())?
    });
    match r {
        Ok(s) => s,
        Err(e) => panic!("the local control plane is not available: {e}"),
    }
}

impl Shared {
    /// The admin kubeconfig.
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// Admin client config; build clients per test (a client belongs to one runtime).
    pub async fn config(&self) -> anyhow::Result<Config> {
        Ok(config_from_file(&self.kubeconfig).await?)
    }

    /// A fresh admin client.
    pub async fn client(&self) -> anyhow::Result<Client> {
        Ok(Client::try_from(self.config().await?)?)
    }

    /// Whether this cluster has the real node (and test namespaces put their Pods on it).
    pub fn real_node(&self) -> bool {
        self.node_socket.is_some()
    }

    /// The image registry the real node pulls from (see [`ControlPlane::registry`]).
    pub fn registry(&self) -> Option<&str> {
        self.registry.as_deref()
    }

    /// Loads an image archive into the real node (see [`ControlPlane::load_image`]).
    pub fn load_image(&self, archive: &Path) -> anyhow::Result<()> {
        let socket = self
            .node_socket
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("this cluster has no real node"))?;
        Ok(crate::node::load_image(socket, archive)?)
    }

    /// A kubeconfig (YAML) for this cluster that authenticates with `token` instead of the admin
    /// identity, e.g. a ServiceAccount token, so only that account's RBAC applies.
    pub fn kubeconfig_with_token(&self, token: &str) -> anyhow::Result<String> {
        kubeconfig_with_token(&self.kubeconfig, token)
    }

    /// A client config that authenticates with `token` (see [`Shared::kubeconfig_with_token`]).
    pub async fn config_with_token(&self, token: &str) -> anyhow::Result<Config> {
        let kc = kube::config::Kubeconfig::from_yaml(&self.kubeconfig_with_token(token)?)?;
        Ok(Config::from_custom_kubeconfig(kc, &Default::default()).await?)
    }

    /// `kubectl` of the pinned version, pointed at this cluster.
    pub fn kubectl(&self) -> Command {
        let mut c = Command::new(&self.kubectl);
        c.env("KUBECONFIG", &self.kubeconfig);
        c
    }

    /// Runs `test` in a fresh namespace named `<prefix>-<random>`. On failure (an error or a
    /// panic) it prints every object and event in the namespace, then fails the test; the
    /// namespace is deleted either way.
    pub async fn in_namespace<F, Fut>(&self, prefix: &str, test: F)
    where
        F: FnOnce(Client, String) -> Fut,
        Fut: Future<Output = anyhow::Result<()>>,
    {
        let client = self
            .client()
            .await
            .expect("admin client for the local control plane");
        let ns = TestNamespace::create_on(client.clone(), prefix, self.real_node())
            .await
            .expect("creating the test namespace");
        let outcome = std::panic::AssertUnwindSafe(test(client, ns.name.clone()))
            .catch_unwind()
            .await;
        let failure = match outcome {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(format!("{e:#}")),
            Err(panic) => Some(
                panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "panic".into()),
            ),
        };
        if let Some(f) = &failure {
            eprintln!(
                "test in namespace {} failed: {f}\n{}",
                ns.name,
                self.dump(&ns.name)
            );
        }
        ns.delete().await;
        if let Some(f) = failure {
            panic!("{f}");
        }
    }

    /// Everything in a namespace, as `kubectl get` shows it, plus its events.
    pub fn dump(&self, ns: &str) -> String {
        let mut out = String::new();
        let resources = self
            .kubectl()
            .args(["api-resources", "--namespaced=true", "--verbs=list", "-o", "name"])
            .output()
            .map(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .filter(|l| *l != "events" && *l != "events.events.k8s.io")
                    .collect::<Vec<_>>()
                    .join(",")
            })
            .unwrap_or_default();
        for args in [
            vec![
                "get",
                resources.as_str(),
                "-n",
                ns,
                "-o",
                "wide",
                "--ignore-not-found",
            ],
            vec![
                "get",
                "deployments,pods",
                "-n",
                ns,
                "-o",
                "yaml",
                "--ignore-not-found",
            ],
            vec!["events", "-n", ns],
        ] {
            if let Ok(o) = self.kubectl().args(&args).output() {
                out.push_str(&format!("--- kubectl {} ---\n", args.join(" ")));
                out.push_str(&String::from_utf8_lossy(&o.stdout));
                out.push_str(&String::from_utf8_lossy(&o.stderr));
            }
        }
        out
    }
}

/// A namespace created for one test.
pub struct TestNamespace {
    /// The generated name (`<prefix>-<random>`).
    pub name: String,
    client: Client,
}

impl TestNamespace {
    /// Creates `<prefix>-<random suffix>`.
    pub async fn create(client: Client, prefix: &str) -> anyhow::Result<TestNamespace> {
        Self::create_on(client, prefix, false).await
    }

    /// Creates `<prefix>-<random suffix>`; with `real_node` every Pod in it runs on the real
    /// node (annotations read by the apiserver's `PodNodeSelector` and
    /// `PodTolerationRestriction`).
    pub async fn create_on(client: Client, prefix: &str, real_node: bool) -> anyhow::Result<TestNamespace> {
        let suffix = format!("{:08x}", rand_u32()?);
        let prefix: String = prefix
            .to_lowercase()
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .take(40)
            .collect();
        let name = format!("{}-{suffix}", prefix.trim_matches('-'));
        let annotations = real_node.then(crate::node::namespace_annotations);
        let ns = Namespace {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                annotations,
                ..Default::default()
            },
            ..Default::default()
        };
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &ns)
            .await?;
        Ok(TestNamespace { name, client })
    }

    /// Deletes the namespace (in the background: the apiserver finishes the job).
    pub async fn delete(self) {
        let _ = Api::<Namespace>::all(self.client)
            .delete(&self.name, &DeleteParams::background())
            .await;
    }
}

fn rand_u32() -> std::io::Result<u32> {
    use std::io::Read;
    let mut b = [0u8; 4];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

/// Polls `check` every 100 ms until it returns `Ok`, or fails after `timeout` with the last
/// error it returned (which should say what was observed instead).
pub async fn wait_for<T, E, F, Fut>(what: &str, timeout: Duration, mut check: F) -> anyhow::Result<T>
where
    E: Display,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let start = Instant::now();
    loop {
        match check().await {
            Ok(v) => return Ok(v),
            Err(e) if start.elapsed() >= timeout => {
                anyhow::bail!("timed out after {:?} waiting for {what}; last seen: {e}", timeout)
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// Checks `check` every 100 ms for `window` and fails at its first `Err`: that nothing happens.
/// Call it once the work that could make something happen has finished, not merely started.
pub async fn consistently<E, F, Fut>(what: &str, window: Duration, mut check: F) -> anyhow::Result<()>
where
    E: Display,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(), E>>,
{
    let start = Instant::now();
    loop {
        if let Err(e) = check().await {
            anyhow::bail!("{what} no longer held after {:?}: {e}", start.elapsed());
        }
        if start.elapsed() >= window {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A bare HTTP/1.0 GET on a local endpoint (metrics, probes): returns status code and body.
pub async fn http_get(addr: std::net::SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    http_request(addr, "GET", path, None).await
}

/// A bare HTTP/1.0 request on a local endpoint, with an optional JSON body: returns status code
/// and body.
pub async fn http_request(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    json: Option<&str>,
) -> std::io::Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    let body = match json {
        Some(b) => format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{b}",
            b.len()
        ),
        None => "\r\n".to_string(),
    };
    s.write_all(format!("{method} {path} HTTP/1.0\r\nHost: localhost\r\n{body}").as_bytes())
        .await?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).await?;
    status_and_body(&buf)
}

/// The status code and body of a whole HTTP/1 response.
fn status_and_body(response: &str) -> std::io::Result<(u16, String)> {
    let code = response
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("no HTTP status line in {response:?}")))?;
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((code, body))
}

/// The kubeconfig at `path` (YAML) with its user authenticating with `token` instead, e.g. a
/// ServiceAccount token, so only that account's RBAC applies.
pub fn kubeconfig_with_token(path: &std::path::Path, token: &str) -> anyhow::Result<String> {
    let mut kc: serde_json::Value = serde_saphyr::from_str(&std::fs::read_to_string(path)?)?;
    kc["users"][0]["user"] = serde_json::Value::Object(
        [("token".to_string(), serde_json::Value::from(token))]
            .into_iter()
            .collect(),
    );
    Ok(serde_saphyr::to_string(&kc)?)
}

/// A certificate verifier that accepts any server: for endpoints whose real clients skip
/// verification too (Prometheus scraping a self-signed `/metrics`) and authenticate by token.
#[derive(Debug)]
struct AnyServer(Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for AnyServer {
    fn verify_server_cert(
        &self,
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &[rustls::pki_types::CertificateDer<'_>],
        _: &rustls::pki_types::ServerName<'_>,
        _: &[u8],
        _: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }
    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// A TLS client trusting only `ca` (PEM), offering HTTP/2 and HTTP/1.1.
pub fn tls_connector(ca: &[u8]) -> anyhow::Result<tokio_rustls::TlsConnector> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca) {
        roots.add(c?)?;
    }
    let mut config =
        rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

/// Whether a TLS client that trusts only `ca` (PEM) completes a handshake with the server on
/// localhost `port`, named `127.0.0.1`.
pub async fn tls_trusted(port: u16, ca: &[u8]) -> anyhow::Result<bool> {
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    Ok(tls_connector(ca)?
        .connect("127.0.0.1".try_into()?, tcp)
        .await
        .is_ok())
}

/// A GET over HTTPS with an optional bearer token: status code and body. Any server
/// certificate is accepted, as Prometheus does for a self-signed `/metrics`.
pub async fn https_get(
    addr: std::net::SocketAddr,
    path: &str,
    token: Option<&str>,
) -> std::io::Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(std::io::Error::other)?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyServer(provider)))
        .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let name = rustls::pki_types::ServerName::from(addr.ip());
    let mut tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await?;
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    tls.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: localhost\r\n{auth}Connection: close\r\n\r\n").as_bytes(),
    )
    .await?;
    // A TLS stream's `write_all` may leave the request in the TLS buffer (its socket was not
    // writable just then) until a flush: without one, the server may never see it.
    tls.flush().await?;
    let mut buf = Vec::new();
    // A server that closes without TLS's close_notify fails the read after a whole answer;
    // with no answer at all, the failure is what happened.
    if let Err(e) = tls.read_to_end(&mut buf).await
        && buf.is_empty()
    {
        return Err(std::io::Error::other(format!("no answer to GET {path}: {e}")));
    }
    status_and_body(&String::from_utf8_lossy(&buf))
}
