//! A fault-injecting proxy between a client under test and the apiserver: plain HTTP on
//! localhost in front, the apiserver (with the admin client's credentials) behind. It can
//! answer 429 with `Retry-After` or any other error status, delay answers, take a request and
//! never answer (what a half-open connection looks like to the client) or stop half-way
//! through an answer's body, for writes, for reads, or for both (or for the next write of one
//! content type alone), and it counts the requests that reached it.
use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body as AxumBody;
use axum::extract::{ConnectInfo, Request, State};
use axum::response::Response;
use http::{Method, StatusCode};
use kube::Client;

/// What the proxy does to a request.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum Fault {
    /// Forward it.
    #[default]
    Pass,
    /// Answer 429 with `Retry-After: <seconds>` without forwarding.
    TooManyRequests {
        /// The `Retry-After` value.
        retry_after_secs: u32,
    },
    /// Answer with this status (and a Kubernetes `Status` body) without forwarding.
    Status(u16),
    /// Forward it after this long.
    Delay(Duration),
    /// Take it and never answer, until the client gives up.
    Hang,
    /// [`Fault::Hang`] for requests on connections opened before the fault was set; new
    /// connections pass: what a half-open connection looks like (the peer is gone for the
    /// connections that existed, a new one reaches it).
    HalfOpen,
    /// Forward it and send the answer's head and the first half of its body, then nothing
    /// more: a connection that stops in the middle of a response.
    StallBody,
}

#[derive(Default)]
struct Faults {
    writes: Fault,
    reads: Fault,
    /// Requests whose path contains this pass whatever the faults.
    spare: Option<String>,
    /// The next write with this `Content-Type` meets this fault instead (then it is gone).
    once: Option<(String, Fault)>,
}

struct Shared {
    upstream: Client,
    faults: Mutex<Faults>,
    /// Client addresses (one per connection) seen so far, and those seen before the last
    /// [`FaultProxy::set`].
    peers: Mutex<(HashSet<SocketAddr>, HashSet<SocketAddr>)>,
    writes: AtomicU64,
    reads: AtomicU64,
    faulted: AtomicU64,
}

/// A running proxy; stops when dropped.
pub struct FaultProxy {
    port: u16,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn writes(m: &Method) -> bool {
    !matches!(*m, Method::GET | Method::HEAD | Method::OPTIONS)
}

impl FaultProxy {
    /// Listens on a free localhost port and forwards to the apiserver `upstream` talks to.
    pub async fn start(upstream: Client) -> std::io::Result<FaultProxy> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let shared = Arc::new(Shared {
            upstream,
            faults: Mutex::default(),
            peers: Mutex::default(),
            writes: AtomicU64::new(0),
            reads: AtomicU64::new(0),
            faulted: AtomicU64::new(0),
        });
        let app = axum::Router::new().fallback(forward).with_state(shared.clone());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>()).await;
        });
        Ok(FaultProxy { port, shared, task })
    }

    /// A client configuration that talks to the apiserver through this proxy (no credentials
    /// needed: the proxy adds its own).
    pub fn config(&self) -> kube::Config {
        let url = format!("http://127.0.0.1:{}", self.port);
        kube::Config::new(url.parse().expect("a valid url"))
    }

    /// What happens from now on to writes (any method but GET/HEAD) and to reads.
    pub fn set(&self, writes: Fault, reads: Fault) {
        self.set_sparing(writes, reads, None);
    }

    /// [`FaultProxy::set`], except for requests whose path contains `spare` (say `/leases/`,
    /// to fault a leader's work but not its renewals).
    pub fn set_sparing(&self, writes: Fault, reads: Fault, spare: Option<&str>) {
        let mut f = self.shared.faults.lock().unwrap_or_else(|p| p.into_inner());
        let mut peers = self.shared.peers.lock().unwrap_or_else(|p| p.into_inner());
        peers.1 = peers.0.clone();
        (f.writes, f.reads, f.spare) = (writes, reads, spare.map(String::from));
    }

    /// The next write whose `Content-Type` is `content_type` (say
    /// `application/merge-patch+json`) meets `fault`; the writes before and after it meet the
    /// faults [`FaultProxy::set`] chose.
    pub fn once(&self, content_type: &str, fault: Fault) {
        let mut f = self.shared.faults.lock().unwrap_or_else(|p| p.into_inner());
        f.once = Some((content_type.to_string(), fault));
    }

    /// How many write requests reached the proxy (answered, failed or held).
    pub fn writes_seen(&self) -> u64 {
        self.shared.writes.load(Ordering::SeqCst)
    }

    /// How many requests met a fault (answered with an error, delayed or held).
    pub fn faulted(&self) -> u64 {
        self.shared.faulted.load(Ordering::SeqCst)
    }

    /// How many read requests reached the proxy.
    pub fn reads_seen(&self) -> u64 {
        self.shared.reads.load(Ordering::SeqCst)
    }
}

fn status(code: StatusCode, body: String) -> Response {
    let mut r = Response::new(AxumBody::from(body));
    *r.status_mut() = code;
    r
}

async fn forward(
    State(shared): State<Arc<Shared>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    req: Request,
) -> Response {
    let write = writes(req.method());
    let old_connection = {
        let mut peers = shared.peers.lock().unwrap_or_else(|p| p.into_inner());
        peers.0.insert(peer);
        peers.1.contains(&peer)
    };
    let counter = if write { &shared.writes } else { &shared.reads };
    counter.fetch_add(1, Ordering::SeqCst);
    let fault = {
        let mut f = shared.faults.lock().unwrap_or_else(|p| p.into_inner());
        let content_type = req.headers().get(http::header::CONTENT_TYPE);
        let once = match &f.once {
            Some((wanted, _)) => write && content_type.is_some_and(|c| c.as_bytes() == wanted.as_bytes()),
            None => false,
        };
        let spared = f
            .spare
            .as_ref()
            .is_some_and(|s| req.uri().path().contains(s.as_str()));
        match (spared, write) {
            _ if once => f.once.take().map(|(_, fault)| fault).unwrap_or_default(),
            (true, _) => Fault::Pass,
            (false, true) => f.writes.clone(),
            (false, false) => f.reads.clone(),
        }
    };
    let met = match fault {
        Fault::Pass => false,
        Fault::HalfOpen => old_connection,
        _ => true,
    };
    if met {
        shared.faulted.fetch_add(1, Ordering::SeqCst);
    }
    match fault {
        Fault::Pass => {}
        Fault::TooManyRequests { retry_after_secs } => {
            let body = serde_json::json!({
                "kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 429,
                "reason": "TooManyRequests", "message": "injected by the fault proxy",
                "details": {"retryAfterSeconds": retry_after_secs}
            });
            let mut r = status(StatusCode::TOO_MANY_REQUESTS, body.to_string());
            r.headers_mut().insert("retry-after", retry_after_secs.into());
            r.headers_mut()
                .insert("content-type", http::HeaderValue::from_static("application/json"));
            return r;
        }
        Fault::Status(code) => {
            let body = serde_json::json!({
                "kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code,
                "message": "injected by the fault proxy"
            });
            let code = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            let mut r = status(code, body.to_string());
            r.headers_mut()
                .insert("content-type", http::HeaderValue::from_static("application/json"));
            return r;
        }
        Fault::Delay(d) => tokio::time::sleep(d).await,
        Fault::Hang => std::future::pending::<()>().await,
        Fault::HalfOpen if old_connection => std::future::pending::<()>().await,
        Fault::HalfOpen | Fault::StallBody => {}
    }
    let (parts, body) = req.into_parts();
    let bytes = match axum::body::to_bytes(body, 64 << 20).await {
        Ok(b) => b,
        Err(e) => return status(StatusCode::BAD_REQUEST, e.to_string()),
    };
    let mut up = http::Request::new(kube::client::Body::from(bytes.to_vec()));
    *up.method_mut() = parts.method;
    *up.uri_mut() = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/")
        .parse()
        .unwrap_or_default();
    for (k, v) in parts.headers.iter() {
        if k != http::header::HOST && k != http::header::CONTENT_LENGTH {
            up.headers_mut().insert(k.clone(), v.clone());
        }
    }
    match shared.upstream.send(up).await {
        Ok(resp) if matches!(fault, Fault::StallBody) => {
            let (mut parts, body) = resp.into_parts();
            let bytes = match axum::body::to_bytes(AxumBody::new(body), 64 << 20).await {
                Ok(b) => b,
                Err(e) => return status(StatusCode::BAD_GATEWAY, e.to_string()),
            };
            // Chunked, so the client cannot tell the answer is incomplete.
            parts.headers.remove(http::header::CONTENT_LENGTH);
            let half = bytes.slice(..bytes.len() / 2);
            let stream = futures::StreamExt::chain(
                futures::stream::once(async move { Ok::<_, std::io::Error>(half) }),
                futures::stream::pending(),
            );
            Response::from_parts(parts, AxumBody::from_stream(stream))
        }
        Ok(resp) => {
            let (parts, body) = resp.into_parts();
            Response::from_parts(parts, AxumBody::new(body))
        }
        Err(e) => status(StatusCode::BAD_GATEWAY, e.to_string()),
    }
}
