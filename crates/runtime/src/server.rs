//! The manager's HTTP endpoints: Prometheus `/metrics`, liveness `/healthz` and readiness
//! `/readyz` (ready once every controller's caches have synced). `/metrics` can be served
//! securely ([`MetricsAuth`]): HTTPS, and only to a bearer token the apiserver authenticates
//! whose user may `get` the non-resource URL `/metrics`, as Kubebuilder's
//! `WithAuthenticationAndAuthorization` filter does.
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{
    NonResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::{Api, PostParams};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;

type Readiness = Arc<Vec<(&'static str, Arc<AtomicBool>)>>;

async fn metrics(State(m): State<Metrics>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        m.encode(),
    )
}

async fn readyz(State(r): State<Readiness>) -> impl IntoResponse {
    let waiting: Vec<&str> = r
        .iter()
        .filter(|(_, ready)| !ready.load(Ordering::SeqCst))
        .map(|(n, _)| *n)
        .collect();
    if waiting.is_empty() {
        (StatusCode::OK, "ok".to_string())
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("caches not synced: {}", waiting.join(", ")),
        )
    }
}

/// Checks who reads `/metrics`: TokenReview, then SubjectAccessReview for `get /metrics`.
/// Decisions are remembered for a minute per token, so a scrape every few seconds costs the
/// apiserver two requests a minute.
#[derive(Clone)]
pub struct MetricsAuth {
    client: kube::Client,
    decisions: Arc<Mutex<HashMap<String, (Instant, StatusCode)>>>,
}

const DECISION_TTL: Duration = Duration::from_secs(60);

impl MetricsAuth {
    /// Reviews tokens through `client` (not the controllers' gated client: a standby must
    /// answer scrapes too).
    pub fn new(client: kube::Client) -> Self {
        MetricsAuth {
            client,
            decisions: Arc::default(),
        }
    }

    /// `OK`, `UNAUTHORIZED` (no token, or one the apiserver does not know) or `FORBIDDEN`
    /// (its user may not `get /metrics`); `SERVICE_UNAVAILABLE` if the apiserver cannot say.
    async fn decide(&self, token: &str) -> (StatusCode, String) {
        let now = Instant::now();
        if let Some((at, code)) = self
            .decisions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(token)
            && now.duration_since(*at) < DECISION_TTL
        {
            return (*code, String::new());
        }
        let (code, why) = match self.review(token).await {
            Ok(d) => d,
            Err(e) => {
                return (
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("reviewing the token: {e}"),
                );
            }
        };
        let mut d = self.decisions.lock().unwrap_or_else(|p| p.into_inner());
        if d.len() > 1000 {
            d.retain(|_, (at, _)| now.duration_since(*at) < DECISION_TTL);
        }
        d.insert(token.to_string(), (now, code));
        (code, why)
    }

    async fn review(&self, token: &str) -> kube::Result<(StatusCode, String)> {
        let pp = PostParams::default();
        let tr = TokenReview {
            spec: TokenReviewSpec {
                token: Some(token.to_string()),
                audiences: None,
            },
            ..Default::default()
        };
        let tr = Api::<TokenReview>::all(self.client.clone())
            .create(&pp, &tr)
            .await?;
        let status = tr.status.unwrap_or_default();
        let (true, Some(user)) = (status.authenticated == Some(true), status.user) else {
            return Ok((StatusCode::UNAUTHORIZED, "the token is not valid".into()));
        };
        let sar = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: user.username.clone(),
                uid: user.uid,
                groups: user.groups,
                extra: user.extra,
                non_resource_attributes: Some(NonResourceAttributes {
                    path: Some("/metrics".into()),
                    verb: Some("get".into()),
                }),
                ..Default::default()
            },
            ..Default::default()
        };
        let sar = Api::<SubjectAccessReview>::all(self.client.clone())
            .create(&pp, &sar)
            .await?;
        let allowed = sar.status.is_some_and(|s| s.allowed);
        let name = user.username.unwrap_or_default();
        Ok(match allowed {
            true => (StatusCode::OK, String::new()),
            false => (StatusCode::FORBIDDEN, format!("{name} may not get /metrics")),
        })
    }
}

async fn authorize(State(auth): State<MetricsAuth>, req: Request, next: Next) -> Response {
    let token = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|t| !t.is_empty());
    let Some(token) = token else {
        return (
            StatusCode::UNAUTHORIZED,
            "Unauthorized: a bearer token is required",
        )
            .into_response();
    };
    match auth.decide(token).await {
        (StatusCode::OK, _) => next.run(req).await,
        (code, why) => (code, why).into_response(),
    }
}

/// Serves `app` over HTTPS with the certificate in `cert_dir`, or one made at start (scrapers
/// verify the token, not the server: Kubebuilder's ServiceMonitor skips verification the same
/// way unless a certificate is mounted), HTTP/1.1 only, at most 64 connections.
fn spawn_tls(
    listener: tokio::net::TcpListener,
    app: Router,
    cert_dir: Option<&std::path::Path>,
    shutdown: CancellationToken,
) -> Result<JoinHandle<()>, String> {
    let certs = match cert_dir {
        Some(dir) => crate::tls::CertSource::Dir(dir.to_path_buf()),
        None => crate::tls::CertSource::Generated(
            crate::tls::self_signed(&["localhost".into()]).map_err(|e| e.to_string())?,
        ),
    };
    let acceptor = crate::tls::acceptor(&certs, false, "metrics", &shutdown)?;
    Ok(crate::https::serve(
        "metrics",
        listener,
        Some(acceptor),
        app,
        limits(),
        shutdown,
    ))
}

/// Why the manager's endpoints could not be served.
#[derive(Debug, thiserror::Error)]
#[allow(missing_docs)] // every variant says what failed in its message
pub enum ServeError {
    #[error("binding {what} on {addr}: {source}")]
    Bind {
        what: &'static str,
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("serving /metrics over HTTPS: {0}")]
    MetricsTls(String),
}

/// Where the manager's endpoints listen.
pub(crate) struct Endpoints<'a> {
    /// `/metrics`; `None` disables it.
    pub metrics: Option<SocketAddr>,
    /// `/healthz` and `/readyz`; `None` disables them.
    pub health: Option<SocketAddr>,
    /// The certificate of `/metrics` over HTTPS; `None` makes one.
    pub metrics_cert_dir: Option<&'a std::path::Path>,
}

async fn bind(what: &'static str, addr: SocketAddr) -> Result<tokio::net::TcpListener, ServeError> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| ServeError::Bind { what, addr, source })
}

/// What one client may cost the manager's endpoints: any Pod can connect to them (the
/// NetworkPolicy admits the probe port from anywhere), and the kubelet, Prometheus and the
/// webhooks' apiserver share the process. At most 64 connections; a silent one is dropped
/// after 10 s, an idle one after [`crate::https::IDLE`], and an idle one gives its slot up to
/// a new one when all are taken.
fn limits() -> crate::https::Limits {
    crate::https::Limits {
        connections: 64,
        handshake: Duration::from_secs(10),
        headers: Duration::from_secs(10),
        idle: crate::https::IDLE,
        reclaim: crate::https::RECLAIM,
        age: Duration::from_secs(120),
        drain: Duration::from_secs(10),
        grace: Duration::ZERO,
        http2: false,
    }
}

/// Serves `app` over plain HTTP within [`limits`].
fn spawn(
    what: &'static str,
    listener: tokio::net::TcpListener,
    app: Router,
    shutdown: CancellationToken,
) -> JoinHandle<()> {
    crate::https::serve(what, listener, None, app, limits(), shutdown)
}

pub(crate) async fn serve(
    at: Endpoints<'_>,
    metrics_state: Metrics,
    auth: Option<MetricsAuth>,
    readiness: Vec<(&'static str, Arc<AtomicBool>)>,
    shutdown: CancellationToken,
) -> Result<Vec<JoinHandle<()>>, ServeError> {
    let mut handles = Vec::new();
    if let Some(addr) = at.metrics {
        let l = bind("metrics", addr).await?;
        let app = Router::new()
            .route("/metrics", get(metrics))
            .with_state(metrics_state);
        match auth {
            Some(auth) => {
                let app = app.layer(axum::middleware::from_fn_with_state(auth, authorize));
                let h = spawn_tls(l, app, at.metrics_cert_dir, shutdown.clone())
                    .map_err(ServeError::MetricsTls)?;
                tracing::info!(%addr, "serving /metrics over HTTPS to authorized readers");
                handles.push(h);
            }
            None => {
                tracing::info!(%addr, "serving /metrics");
                handles.push(spawn("metrics", l, app, shutdown.clone()));
            }
        }
    }
    if let Some(addr) = at.health {
        let l = bind("health probes", addr).await?;
        let app = Router::new()
            .route("/healthz", get(|| async { "ok" }))
            .route("/readyz", get(readyz))
            .with_state(Arc::new(readiness));
        tracing::info!(%addr, "serving /healthz and /readyz");
        handles.push(spawn("health", l, app, shutdown));
    }
    Ok(handles)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// The status line of `GET path` on a new connection to `addr`.
    async fn get(addr: SocketAddr, path: &str) -> std::io::Result<String> {
        let mut s = tokio::net::TcpStream::connect(addr).await?;
        let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await?;
        let mut out = String::new();
        s.read_to_string(&mut out).await?;
        Ok(out.lines().next().unwrap_or_default().to_string())
    }

    #[tokio::test]
    async fn silent_connections_cannot_starve_the_probe_port() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let addr: SocketAddr = ([127, 0, 0, 1], port).into();
        let shutdown = CancellationToken::new();
        let _stop = shutdown.clone().drop_guard();
        let at = Endpoints {
            metrics: None,
            health: Some(addr),
            metrics_cert_dir: None,
        };
        let ready = vec![("c", Arc::new(AtomicBool::new(true)))];
        serve(at, Metrics::default(), None, ready, shutdown.clone())
            .await
            .unwrap();
        // More silent connections than the port serves at once (any Pod may open them).
        let mut silent = Vec::new();
        for _ in 0..limits().connections + 20 {
            silent.push(tokio::net::TcpStream::connect(addr).await.unwrap());
        }
        // The kubelet's probe is still answered, once the silent ones are dropped.
        let started = std::time::Instant::now();
        let status = tokio::time::timeout(limits().headers * 3, get(addr, "/healthz"))
            .await
            .expect("answered while silent connections were held")
            .unwrap();
        assert!(status.starts_with("HTTP/1.1 200"), "{status}");
        assert!(started.elapsed() < limits().headers * 3);
        // The first silent connection was closed by the server, not kept.
        let mut buf = [0u8; 1];
        let read = tokio::time::timeout(limits().headers * 2, silent[0].read(&mut buf))
            .await
            .expect("the server closed the silent connection");
        assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    }
}
