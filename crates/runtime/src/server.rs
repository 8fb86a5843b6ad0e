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

async fn readyz(State((r, m)): State<(Readiness, Metrics)>) -> impl IntoResponse {
    let waiting: Vec<&str> = r
        .iter()
        .filter(|(_, ready)| !ready.load(Ordering::SeqCst))
        .map(|(n, _)| *n)
        .collect();
    if waiting.is_empty() {
        let inactive = m.inactive_watches();
        if inactive.is_empty() {
            (StatusCode::OK, "ok".to_string())
        } else {
            // Ready: an optional watch waits for its kind without holding the rest back.
            (
                StatusCode::OK,
                format!(
                    "ok; optional watches waiting for their kind: {}",
                    inactive.join(", ")
                ),
            )
        }
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("caches not synced: {}", waiting.join(", ")),
        )
    }
}

/// Checks who reads `/metrics`: TokenReview, then SubjectAccessReview for `get /metrics`.
/// Decisions are remembered per token (a minute when allowed, 5 s when refused, at most 1024,
/// by the token's hash), so a scrape every few seconds costs the apiserver two requests a
/// minute, and a flood of made-up tokens costs bounded memory and at most 4 reviews at once.
#[derive(Clone)]
pub struct MetricsAuth {
    client: kube::Client,
    decisions: Decisions,
}

/// How long an allowed token is trusted without asking again.
const ALLOWED_TTL: Duration = Duration::from_secs(60);
/// How long a refusal is remembered: short, so a token granted access a moment ago is not
/// refused for long, and long enough that a scraper retrying a bad token costs little.
const REFUSED_TTL: Duration = Duration::from_secs(5);
/// Decisions remembered at most (the least recently used goes first): a few hundred bytes
/// each, whatever the tokens a client makes up.
const DECISIONS: usize = 1024;
/// Token reviews in flight at most; further requests wait their turn.
const REVIEWS: usize = 4;
/// A longer bearer token is refused unread (service account and OIDC tokens are a few KiB).
const MAX_TOKEN: usize = 16 * 1024;

/// A token's decision: who may read `/metrics`, remembered by the token's SHA-256 (never the
/// token itself), bounded in number, with one review in flight per token and [`REVIEWS`] in
/// all.
#[derive(Clone)]
struct Decisions {
    inner: Arc<Mutex<DecisionMap>>,
    reviews: Arc<tokio::sync::Semaphore>,
}

type TokenKey = [u8; 32];
type Pending = Arc<tokio::sync::OnceCell<(StatusCode, String)>>;

#[derive(Default)]
struct DecisionMap {
    /// How long an allowed and a refused decision last.
    ttl: (Duration, Duration),
    /// Decision, when it was made and when it was last used.
    known: HashMap<TokenKey, (StatusCode, Instant, Instant)>,
    /// Reviews under way, shared by every request with that token.
    pending: HashMap<TokenKey, Pending>,
}

impl Default for Decisions {
    fn default() -> Self {
        Decisions::lasting(ALLOWED_TTL, REFUSED_TTL)
    }
}

impl Decisions {
    fn lasting(allowed: Duration, refused: Duration) -> Self {
        Decisions {
            inner: Arc::new(Mutex::new(DecisionMap {
                ttl: (allowed, refused),
                ..Default::default()
            })),
            reviews: Arc::new(tokio::sync::Semaphore::new(REVIEWS)),
        }
    }

    /// The decision for `token`: remembered, or made by `review` (once, however many
    /// requests carry the token meanwhile). An error of `review` is not remembered.
    async fn decide<F, Fut>(&self, token: &str, review: F) -> (StatusCode, String)
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = kube::Result<(StatusCode, String)>>,
    {
        if token.len() > MAX_TOKEN {
            return (
                StatusCode::UNAUTHORIZED,
                format!("a bearer token longer than {MAX_TOKEN} bytes is not reviewed"),
            );
        }
        let key: TokenKey = ring::digest::digest(&ring::digest::SHA256, token.as_bytes())
            .as_ref()
            .try_into()
            .unwrap_or_default();
        let pending = {
            let mut m = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            let now = Instant::now();
            let ttl = m.ttl;
            if let Some((code, at, used)) = m.known.get_mut(&key)
                && now.duration_since(*at) < lasts(ttl, *code)
            {
                *used = now;
                return (*code, String::new());
            }
            m.pending.entry(key).or_default().clone()
        };
        // Whatever ends this request (its client may go away mid-review), the entry goes
        // once decided (remembered) or once no other request waits on it.
        let leaving = Leaving {
            map: &self.inner,
            key,
            pending,
        };
        let (code, why) = leaving
            .pending
            .get_or_init(|| async {
                let _turn = self.reviews.acquire().await;
                match review().await {
                    Ok(d) => d,
                    Err(e) => (
                        StatusCode::SERVICE_UNAVAILABLE,
                        format!("reviewing the token: {e}"),
                    ),
                }
            })
            .await
            .clone();
        (code, why)
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).known.len()
    }

    #[cfg(test)]
    fn pending(&self) -> usize {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).pending.len()
    }
}

/// Takes a request's pending review out of the map when the request ends: decided, its
/// answer is remembered (a failed review is not); dropped undecided, it goes unless another
/// request still waits on it (which then takes the review over).
struct Leaving<'a> {
    map: &'a Mutex<DecisionMap>,
    key: TokenKey,
    pending: Pending,
}

impl Drop for Leaving<'_> {
    fn drop(&mut self) {
        let mut m = self.map.lock().unwrap_or_else(|p| p.into_inner());
        let ours = m
            .pending
            .get(&self.key)
            .is_some_and(|p| Arc::ptr_eq(p, &self.pending));
        if !ours {
            return;
        }
        match self.pending.get() {
            Some((code, _)) => {
                let code = *code;
                m.pending.remove(&self.key);
                if code != StatusCode::SERVICE_UNAVAILABLE {
                    m.remember(self.key, code);
                }
            }
            // Held by the map and by this request alone: nobody else needs it.
            None if Arc::strong_count(&self.pending) <= 2 => {
                m.pending.remove(&self.key);
            }
            None => {}
        }
    }
}

/// How long a decision `code` lasts, of `(allowed, refused)`.
fn lasts((allowed, refused): (Duration, Duration), code: StatusCode) -> Duration {
    if code == StatusCode::OK { allowed } else { refused }
}

impl DecisionMap {
    fn remember(&mut self, key: TokenKey, code: StatusCode) {
        let now = Instant::now();
        if self.known.len() >= DECISIONS && !self.known.contains_key(&key) {
            // Expired ones first; then the least recently used refusal (made-up tokens cannot
            // push out the scraper's), then the least recently used.
            let ttl = self.ttl;
            self.known
                .retain(|_, (code, at, _)| now.duration_since(*at) < lasts(ttl, *code));
            if self.known.len() >= DECISIONS
                && let Some(oldest) = self
                    .known
                    .iter()
                    .min_by_key(|(_, (code, _, used))| (*code == StatusCode::OK, *used))
                    .map(|(k, _)| *k)
            {
                self.known.remove(&oldest);
            }
        }
        self.known.insert(key, (code, now, now));
    }
}

impl MetricsAuth {
    /// Reviews tokens through `client` (not the controllers' gated client: a standby must
    /// answer scrapes too).
    pub fn new(client: kube::Client) -> Self {
        MetricsAuth {
            client,
            decisions: Decisions::default(),
        }
    }

    /// `OK`, `UNAUTHORIZED` (no token, or one the apiserver does not know) or `FORBIDDEN`
    /// (its user may not `get /metrics`); `SERVICE_UNAVAILABLE` if the apiserver cannot say.
    async fn decide(&self, token: &str) -> (StatusCode, String) {
        self.decisions.decide(token, || self.review(token)).await
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
/// after 10 s (over TLS, one silent since its handshake counts as idle), an idle one after
/// [`crate::https::IDLE`], and an idle or silent one gives its slot up to a new one when all
/// are taken.
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
            .with_state(metrics_state.clone());
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
            .with_state((Arc::new(readiness), metrics_state));
        tracing::info!(%addr, "serving /healthz and /readyz");
        handles.push(spawn("health", l, app, shutdown));
    }
    Ok(handles)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A review that counts its calls and the most in flight at once, and answers `code`.
    #[derive(Clone, Default)]
    struct Reviews {
        calls: Arc<AtomicUsize>,
        running: Arc<AtomicUsize>,
        most: Arc<AtomicUsize>,
    }

    impl Reviews {
        async fn review(&self, code: StatusCode) -> kube::Result<(StatusCode, String)> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
            self.most.fetch_max(now, Ordering::SeqCst);
            tokio::task::yield_now().await;
            self.running.fetch_sub(1, Ordering::SeqCst);
            Ok((code, String::new()))
        }
        fn calls(&self) -> usize {
            self.calls.load(Ordering::SeqCst)
        }
    }

    #[tokio::test]
    async fn ten_thousand_made_up_tokens_cost_bounded_memory_and_reviews_and_keep_the_scrapers() {
        let (d, r) = (Decisions::default(), Reviews::default());
        let scraper = "the-scraper";
        assert_eq!(
            d.decide(scraper, || r.review(StatusCode::OK)).await.0,
            StatusCode::OK
        );
        let flood = (0..10_000).map(|i| {
            let (d, r) = (d.clone(), r.clone());
            async move {
                d.decide(&format!("made-up-{i}"), || r.review(StatusCode::UNAUTHORIZED))
                    .await
                    .0
            }
        });
        let codes = futures::future::join_all(flood).await;
        assert!(codes.iter().all(|c| *c == StatusCode::UNAUTHORIZED));
        assert_eq!(r.calls(), 10_001, "one review per distinct token");
        assert!(
            r.most.load(Ordering::SeqCst) <= REVIEWS,
            "at most {REVIEWS} reviews at once"
        );
        assert!(d.len() <= DECISIONS, "{} decisions kept", d.len());
        // The scraper's decision outlived the flood: no new review.
        assert_eq!(
            d.decide(scraper, || r.review(StatusCode::OK)).await.0,
            StatusCode::OK
        );
        assert_eq!(r.calls(), 10_001);
    }

    #[tokio::test]
    async fn requests_with_one_token_share_one_review_and_a_refusal_is_remembered_briefly() {
        let (allowed, refused) = (Duration::from_millis(1200), Duration::from_millis(300));
        let (d, r) = (Decisions::lasting(allowed, refused), Reviews::default());
        let same = (0..100).map(|_| d.decide("t", || r.review(StatusCode::FORBIDDEN)));
        let codes = futures::future::join_all(same).await;
        let refused_at = Instant::now();
        assert!(codes.iter().all(|(c, _)| *c == StatusCode::FORBIDDEN));
        assert_eq!(r.calls(), 1, "one review in flight per token");
        d.decide("t", || r.review(StatusCode::OK)).await;
        assert!(
            refused_at.elapsed() < refused,
            "checked within the refusal's life"
        );
        assert_eq!(r.calls(), 1, "a refusal is remembered");
        tokio::time::sleep(refused).await;
        assert_eq!(d.decide("t", || r.review(StatusCode::OK)).await.0, StatusCode::OK);
        let allowed_at = Instant::now();
        assert_eq!(r.calls(), 2, "then asked again");
        tokio::time::sleep(refused * 2).await;
        d.decide("t", || r.review(StatusCode::OK)).await;
        assert!(
            allowed_at.elapsed() < allowed,
            "checked within the decision's life"
        );
        assert_eq!(r.calls(), 2, "an allowed token is trusted longer");
    }

    #[tokio::test]
    async fn a_request_that_goes_away_mid_review_leaves_nothing_behind() {
        let (d, r) = (Decisions::default(), Reviews::default());
        // Requests whose clients leave while their review waits or runs.
        for i in 0..100 {
            let token = format!("gone-{i}");
            let review = || async {
                tokio::time::sleep(Duration::from_secs(60)).await;
                r.review(StatusCode::UNAUTHORIZED).await
            };
            let left = tokio::time::timeout(Duration::from_millis(1), d.decide(&token, review)).await;
            assert!(left.is_err(), "the request should still be waiting");
        }
        assert_eq!(d.pending(), 0, "reviews of requests that went away are forgotten");
        // One of two requests with the same token leaves: the other still gets its answer.
        let waiting = d.decide("shared", || async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            r.review(StatusCode::FORBIDDEN).await
        });
        let leaving = tokio::time::timeout(
            Duration::from_millis(1),
            d.decide("shared", || r.review(StatusCode::FORBIDDEN)),
        );
        let (answer, left) = tokio::join!(waiting, leaving);
        assert!(left.is_err());
        assert_eq!(answer.0, StatusCode::FORBIDDEN);
        assert_eq!(d.pending(), 0);
    }

    #[tokio::test]
    async fn an_oversized_token_is_refused_unreviewed_and_a_failed_review_is_not_remembered() {
        let (d, r) = (Decisions::default(), Reviews::default());
        let (code, why) = d
            .decide(&"x".repeat(MAX_TOKEN + 1), || r.review(StatusCode::OK))
            .await;
        assert_eq!((code, r.calls()), (StatusCode::UNAUTHORIZED, 0), "{why}");
        let failed = d
            .decide("t", || async {
                Err(kube::Error::LinesCodecMaxLineLengthExceeded)
            })
            .await;
        assert_eq!(failed.0, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(d.decide("t", || r.review(StatusCode::OK)).await.0, StatusCode::OK);
    }

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
