//! The client controllers talk to the cluster with: kube's stack, but with the write gate and
//! a deadline on **every attempt**, retries included.
//!
//! kube's default client retries 429/503/504 (honouring `Retry-After`) inside its stack, so a
//! write checked against the gate once could be re-sent seconds later, after the Lease passed
//! to another replica. Here the retry layer sits above a layer that, for each attempt:
//! - refuses a write (any method but GET/HEAD) while the gate is closed, before sending it;
//! - bounds the attempt by the time the gate stays open (with leader election) and by the
//!   request timeout, so no attempt is still waiting for its answer when the gate closes;
//! - bounds every other request but a watch by the request timeout, so a half-open connection
//!   fails the request instead of hanging it (watches have kube's own idle timeout).
//!
//! The bound covers the whole answer: the response head and then the body, so a connection
//! that stops half-way through a large list fails it too.
//!
//! Writes also travel on connections of their own, which check the gate again before every
//! byte they send: a process frozen (SIGSTOP, a VM pause) after the attempt's check but before
//! its request left finds the gate closed when it runs again, and the request never leaves.
//! With leader election their sockets have a TCP user timeout of half the Lease's margin
//! (duration less renew deadline): bytes the apiserver has not acknowledged by then are not
//! sent again, so a write cut off by a partition cannot land once the partition heals, after
//! another replica took over. (Bytes the apiserver's kernel acknowledged are read by the
//! apiserver even after the connection is reset: no client can take those back.) Through a
//! proxy, the gated connection is the one to the proxy.
//! Reads keep kube's connections (and its idle timeout on watches).
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::FutureExt;
use http::{Method, Request, Response};
use http_body_util::BodyExt;
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::{TokioExecutor, TokioIo};
use kube::client::{Body, ClientBuilder, ConfigExt, DynBody};
use kube::{Client, Config};
use tower::buffer::BufferLayer;
use tower::retry::RetryLayer;
use tower::util::BoxCloneSyncService;
use tower::{BoxError, Layer, Service, ServiceBuilder, ServiceExt};

use crate::leader::{NotLeader, WriteGate};
use crate::metrics::Metrics;

/// Longest wait for the answer to one request (not a watch) by default.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// An attempt that got no answer within its deadline.
#[derive(Debug, thiserror::Error)]
#[error("no answer from the apiserver within {after:?} ({why})")]
pub struct TimedOut {
    /// How long the attempt waited.
    pub after: Duration,
    /// `request timeout` or `write gate closing`.
    pub why: &'static str,
}

/// Builds the controllers' client from `config`: kube's stack without its own retry layer for
/// reads, connections of their own for writes (see the module), then [`Attempt`] (the gate and
/// the deadline), then kube's server-aware retry policy.
pub fn build(
    config: Config,
    gate: &WriteGate,
    request_timeout: Duration,
    metrics: &Metrics,
) -> kube::Result<Client> {
    let mut config = config;
    config.default_retry = false;
    let writes = write_pool(&config, gate)?;
    let host = config
        .cluster_url
        .authority()
        .map(|a| a.to_string())
        .unwrap_or_default();
    let builder = ClientBuilder::try_from(config)?;
    let attempts = AttemptLayer {
        gate: gate.clone(),
        timeout: request_timeout,
        metrics: metrics.clone(),
        host,
    };
    Ok(builder
        .with_layer(&RouteLayer { writes })
        .with_layer(&attempts)
        .with_layer(&BufferLayer::new(1024))
        .with_layer(&RetryLayer::new(kube::client::retry::RetryPolicy::server_retry()))
        .build())
}

/// Connects directly when `NO_PROXY` (or `no_proxy`, read through `env`) names the apiserver:
/// kube's kubeconfig loader takes `HTTPS_PROXY` but checks `NO_PROXY` against the proxy's own
/// address, so a local cluster behind a developer's proxy settings would be reached through
/// the proxy. Entries: `*`, a host or domain (`example.com` and `.example.com` both match
/// its subdomains), an IP address, or an IP network (`10.0.0.0/8`); a `:port` is ignored.
pub(crate) fn honour_no_proxy(config: &mut Config, env: impl Fn(&str) -> Option<String>) {
    if config.proxy_url.is_none() {
        return;
    }
    let Some(host) = config.cluster_url.host() else {
        return;
    };
    let host = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_ascii_lowercase();
    let list = env("NO_PROXY")
        .filter(|v| !v.trim().is_empty())
        .or_else(|| env("no_proxy"))
        .unwrap_or_default();
    if list.split(',').any(|entry| no_proxy_matches(entry.trim(), &host)) {
        tracing::info!(host, "NO_PROXY names the apiserver: connecting directly");
        config.proxy_url = None;
    }
}

/// Whether one `NO_PROXY` entry covers `host` (lowercase, without brackets).
fn no_proxy_matches(entry: &str, host: &str) -> bool {
    use std::net::IpAddr;
    let entry = entry.to_ascii_lowercase();
    if entry.is_empty() {
        return false;
    }
    if entry == "*" {
        return true;
    }
    let ip: Option<IpAddr> = host.parse().ok();
    if let Some((net, bits)) = entry.split_once('/') {
        let (Some(ip), Ok(net), Ok(bits)) = (ip, net.parse::<IpAddr>(), bits.parse::<u32>()) else {
            return false;
        };
        return match (ip, net) {
            (IpAddr::V4(a), IpAddr::V4(n)) if bits <= 32 => {
                let mask = if bits == 0 { 0 } else { u32::MAX << (32 - bits) };
                u32::from(a) & mask == u32::from(n) & mask
            }
            (IpAddr::V6(a), IpAddr::V6(n)) if bits <= 128 => {
                let mask = if bits == 0 { 0 } else { u128::MAX << (128 - bits) };
                u128::from(a) & mask == u128::from(n) & mask
            }
            _ => false,
        };
    }
    let bare = entry.trim_start_matches('[');
    let bare = match bare.split_once(']') {
        // `[::1]:6443`
        Some((v6, _)) => v6.to_string(),
        // `host:port`, not an IPv6 address
        None if bare.matches(':').count() == 1 => bare.split(':').next().unwrap_or_default().to_string(),
        None => bare.to_string(),
    };
    if let (Some(ip), Ok(e)) = (ip, bare.parse::<IpAddr>()) {
        return ip == e;
    }
    let domain = bare.trim_start_matches('.');
    !domain.is_empty() && (host == domain || host.ends_with(&format!(".{domain}")))
}

/// Makes [`Attempt`]s.
#[derive(Clone)]
pub struct AttemptLayer {
    gate: WriteGate,
    timeout: Duration,
    metrics: Metrics,
    host: String,
}

impl<S> Layer<S> for AttemptLayer {
    type Service = Attempt<S>;
    fn layer(&self, inner: S) -> Attempt<S> {
        Attempt {
            inner,
            gate: self.gate.clone(),
            timeout: self.timeout,
            metrics: self.metrics.clone(),
            host: self.host.clone(),
        }
    }
}

/// One attempt of one request: gated if it writes, bounded unless it watches.
pub struct Attempt<S> {
    inner: S,
    gate: WriteGate,
    timeout: Duration,
    metrics: Metrics,
    /// The apiserver's `host:port`, the `host` label of `rest_client_*`.
    host: String,
}

/// Whether a request changes state (and so must pass the write gate).
fn writes(method: &Method) -> bool {
    !matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS)
}

/// Whether a GET is a watch (long-running, bounded by kube's watcher instead).
fn watches(req: &Request<Body>) -> bool {
    req.uri()
        .query()
        .is_some_and(|q| q.split('&').any(|p| p == "watch=true" || p == "watch=1"))
}

type RespFuture = Pin<Box<dyn Future<Output = Result<Response<Box<DynBody>>, BoxError>> + Send>>;

impl<S> Service<Request<Body>> for Attempt<S>
where
    S: Service<Request<Body>, Response = Response<Box<DynBody>>, Error = BoxError>,
    S::Future: Send + 'static,
{
    type Response = Response<Box<DynBody>>;
    type Error = BoxError;
    type Future = RespFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Body>) -> RespFuture {
        let now = tokio::time::Instant::now();
        let timeout = now + self.timeout;
        let (deadline, why) = if writes(req.method()) {
            match self.gate.deadline() {
                Err(NotLeader) => {
                    self.metrics.attempt_refused();
                    return Box::pin(async { Err(Box::new(NotLeader) as BoxError) });
                }
                Ok(Some(until)) if until < timeout.into_std() => (Some(until.into()), "write gate closing"),
                Ok(_) => (Some(timeout), "request timeout"),
            }
        } else if watches(&req) {
            (None, "")
        } else {
            (Some(timeout), "request timeout")
        };
        let method = req.method().clone();
        let (metrics, host) = (self.metrics.clone(), self.host.clone());
        let (unanswered_method, unanswered_host) = (method.clone(), host.clone());
        // Every request sent is counted once its answer starts (or fails), by status code.
        let fut = self
            .inner
            .call(req)
            .map(move |r: Result<Response<Box<DynBody>>, BoxError>| {
                let code = match &r {
                    Ok(resp) => resp.status().as_u16().to_string(),
                    Err(_) => "<error>".to_string(),
                };
                let seconds = now.elapsed().as_secs_f64();
                metrics.request(method.as_str(), &host, &code, seconds);
                r
            });
        let Some(deadline) = deadline else {
            return Box::pin(fut);
        };
        let metrics = self.metrics.clone();
        Box::pin(async move {
            match tokio::time::timeout_at(deadline, fut).await {
                Ok(r) => r.map(|resp| {
                    resp.map(|body| {
                        Box::new(DeadlineBody {
                            inner: body,
                            sleep: Box::pin(tokio::time::sleep_until(deadline)),
                            after: deadline.saturating_duration_since(now),
                            why,
                            metrics,
                        }) as Box<DynBody>
                    })
                }),
                Err(_) => {
                    metrics.request_timed_out(why);
                    let seconds = now.elapsed().as_secs_f64();
                    metrics.request(unanswered_method.as_str(), &unanswered_host, "<error>", seconds);
                    Err(Box::new(TimedOut {
                        after: deadline.saturating_duration_since(now),
                        why,
                    }) as BoxError)
                }
            }
        })
    }
}

/// A response body that fails once the attempt's deadline passes, so a connection that stops
/// in the middle of a body fails the request instead of hanging it.
struct DeadlineBody {
    inner: Box<DynBody>,
    sleep: Pin<Box<tokio::time::Sleep>>,
    after: Duration,
    why: &'static str,
    metrics: Metrics,
}

impl http_body::Body for DeadlineBody {
    type Data = bytes::Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<bytes::Bytes>, BoxError>>> {
        let this = &mut *self;
        if let Poll::Ready(frame) = Pin::new(&mut this.inner).poll_frame(cx) {
            return Poll::Ready(frame);
        }
        if this.sleep.as_mut().poll(cx).is_ready() {
            this.metrics.request_timed_out(this.why);
            return Poll::Ready(Some(Err(Box::new(TimedOut {
                after: this.after,
                why: this.why,
            }))));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// Whether `err` (from any kube call) is a write the gate refused before sending it.
pub fn refused_by_gate(err: &kube::Error) -> bool {
    refusal_in(err)
}

/// Whether the API server refused a write because its namespace is being deleted (a 403 with
/// the `NamespaceTerminating` cause): routine while a namespace goes, not a failure.
pub(crate) fn namespace_terminating(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 403
        && s.details.as_ref().is_some_and(|d| d.causes.iter().any(|c| c.reason == "NamespaceTerminating")))
}

fn refusal_in(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut source = Some(err);
    while let Some(e) = source {
        // `io::Error` hides what it wraps from `source()`.
        let wrapped = e
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            .is_some_and(|inner| inner.is::<NotLeader>());
        if e.is::<NotLeader>() || wrapped {
            return true;
        }
        source = e.source();
    }
    false
}

/// The connections writes travel on.
type WritePool = BoxCloneSyncService<Request<Body>, Response<Box<DynBody>>, BoxError>;

/// A connection pool of its own for writes, as kube builds its client (TLS, server name,
/// base URI, credentials, extra headers, an HTTP or SOCKS proxy) but on [`GatedStream`]s: the
/// TCP connection to a proxy is gated as the one to the apiserver would be.
fn write_pool(config: &Config, gate: &WriteGate) -> kube::Result<WritePool> {
    use hyper_util::client::legacy::connect::proxy::{SocksV5, Tunnel};
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_connect_timeout(config.connect_timeout);
    http.set_nodelay(true);
    let gated = GatedConnector {
        http,
        gate: gate.clone(),
    };
    let Some(proxy) = config.proxy_url.clone() else {
        return pool_over(config, gated);
    };
    let auth = proxy
        .authority()
        .and_then(|a| a.as_str().rsplit_once('@'))
        .and_then(|(userinfo, _)| proxy_auth(userinfo));
    fn tunnel<C>(proxy: http::Uri, to_proxy: C, auth: Option<http::HeaderValue>) -> Tunnel<C> {
        let t = Tunnel::new(proxy, to_proxy);
        match auth {
            Some(auth) => t.with_auth(auth),
            None => t,
        }
    }
    match proxy.scheme_str() {
        Some("socks5") => pool_over(config, SocksV5::new(proxy, gated)),
        Some("http") => pool_over(config, tunnel(proxy, gated, auth)),
        Some("https") => {
            let to_proxy = config.rustls_https_connector_with_connector(gated)?;
            pool_over(config, tunnel(proxy, to_proxy, auth))
        }
        _ => Err(kube::Error::ProxyProtocolUnsupported {
            proxy_url: Box::new(proxy),
        }),
    }
}

/// `Proxy-Authorization` from a proxy URL's `user:password` (percent-escapes decoded, as kube
/// does for its own connections).
fn proxy_auth(userinfo: &str) -> Option<http::HeaderValue> {
    let decoded: Vec<u8> = percent_encoding::percent_decode_str(userinfo).collect();
    http::HeaderValue::from_str(&format!("Basic {}", crate::migrate::base64(&decoded))).ok()
}

/// [`write_pool`] over the connector that reaches the apiserver (directly or by a proxy).
fn pool_over<C>(config: &Config, connector: C) -> kube::Result<WritePool>
where
    C: Service<http::Uri> + Clone + Send + Sync + 'static,
    C::Response: hyper::rt::Read + hyper::rt::Write + Connection + Send + Unpin + 'static,
    C::Future: Send + Unpin + 'static,
    C::Error: Into<BoxError>,
{
    let tls = config.rustls_https_connector_with_connector(connector)?;
    let hyper = hyper_util::client::legacy::Builder::new(TokioExecutor::new()).build(tls);
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .map_err(BoxError::from)
        .service(hyper)
        .map_response(|resp: Response<hyper::body::Incoming>| {
            resp.map(|body| Box::new(BodyExt::map_err(body, BoxError::from)) as Box<DynBody>)
        });
    Ok(BoxCloneSyncService::new(service))
}

/// Sends writes to their own pool, everything else to kube's.
struct RouteLayer {
    writes: WritePool,
}

impl<S> Layer<S> for RouteLayer {
    type Service = Route<S>;
    fn layer(&self, reads: S) -> Route<S> {
        Route {
            reads,
            writes: self.writes.clone(),
        }
    }
}

/// See [`RouteLayer`].
struct Route<S> {
    reads: S,
    writes: WritePool,
}

impl<S> Service<Request<Body>> for Route<S>
where
    S: Service<Request<Body>, Response = Response<Box<DynBody>>, Error = BoxError>,
    S::Future: Send + 'static,
{
    type Response = Response<Box<DynBody>>;
    type Error = BoxError;
    type Future = RespFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        std::task::ready!(self.writes.poll_ready(cx))?;
        self.reads.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Body>) -> RespFuture {
        if writes(req.method()) {
            Box::pin(self.writes.call(req))
        } else {
            Box::pin(self.reads.call(req))
        }
    }
}

/// Opens [`GatedStream`]s.
#[derive(Clone)]
struct GatedConnector {
    http: HttpConnector,
    gate: WriteGate,
}

impl Service<http::Uri> for GatedConnector {
    type Response = GatedStream;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<GatedStream, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.http.poll_ready(cx).map_err(BoxError::from)
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let (connecting, gate) = (self.http.call(uri), self.gate.clone());
        Box::pin(async move {
            // Refused here too, not only at the first byte: a proxy's handshake (SOCKS5) may
            // report the failed write without its cause.
            gate.check()?;
            let inner = connecting.await?;
            // TCP_USER_TIMEOUT is Linux's (where operators run); elsewhere the kernel's default.
            #[cfg(any(target_os = "linux", target_os = "android"))]
            if let Some(timeout) = user_timeout(&gate) {
                socket2::SockRef::from(inner.inner()).set_tcp_user_timeout(Some(timeout))?;
            }
            Ok(GatedStream { inner, gate })
        })
    }
}

/// How long a write connection's unacknowledged bytes are sent again before it gives up:
/// half the gate's margin; none without leader election.
#[cfg(any(target_os = "linux", target_os = "android"))]
fn user_timeout(gate: &WriteGate) -> Option<Duration> {
    gate.margin().map(|m| m / 2).filter(|t| !t.is_zero())
}

/// A TCP connection that sends nothing while the write gate is closed: the last check before
/// a request's bytes leave the process (TLS sits above it, so this sees every byte).
struct GatedStream {
    inner: TokioIo<tokio::net::TcpStream>,
    gate: WriteGate,
}

impl GatedStream {
    fn open(&self) -> std::io::Result<()> {
        self.gate.check().map_err(std::io::Error::other)
    }
}

impl hyper::rt::Read for GatedStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl hyper::rt::Write for GatedStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.open()?;
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        self.open()?;
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl Connection for GatedStream {
    fn connected(&self) -> Connected {
        self.inner.connected()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_refused_as_its_namespace_goes_is_told_apart_from_other_refusals() {
        // As kube-apiserver answers a create in a namespace being deleted.
        let status = |cause: &str| {
            let body = serde_json::json!({
                "kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden",
                "message": "configmaps \"c\" is forbidden: unable to create new content in namespace n because it is being terminated",
                "details": {"name": "c", "kind": "configmaps", "causes": [
                    {"reason": cause, "message": "namespace n is being terminated", "field": "metadata.namespace"}]},
                "code": 403,
            });
            kube::Error::Api(Box::new(serde_json::from_value(body).unwrap()))
        };
        assert!(namespace_terminating(&status("NamespaceTerminating")));
        assert!(!namespace_terminating(&status("FieldValueForbidden")));
    }

    fn req(method: Method, uri: &str) -> Request<Body> {
        let mut r = Request::new(Body::empty());
        *r.method_mut() = method;
        *r.uri_mut() = uri.parse().expect("a valid uri");
        r
    }

    /// A server that answers every request `200` and reports, per connection, the bytes it
    /// received once the client closed it.
    async fn counting_server() -> (u16, tokio::sync::mpsc::UnboundedReceiver<usize>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let tx = tx.clone();
                tokio::spawn(async move {
                    let (mut total, mut head) = (0, Vec::new());
                    let mut buf = [0u8; 4096];
                    while let Ok(n) = conn.read(&mut buf).await {
                        if n == 0 {
                            break;
                        }
                        total += n;
                        head.extend_from_slice(&buf[..n]);
                        if head.windows(4).any(|w| w == b"\r\n\r\n") {
                            head.clear();
                            let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
                            if conn.write_all(ok).await.is_err() {
                                break;
                            }
                        }
                    }
                    let _ = tx.send(total);
                });
            }
        });
        (port, rx)
    }

    #[cfg(any(target_os = "linux", target_os = "android"))]
    #[tokio::test]
    async fn write_connections_give_up_on_unacknowledged_bytes_within_half_the_margin() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let uri: http::Uri = format!("http://{}", listener.local_addr().unwrap())
            .parse()
            .unwrap();
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        let gate = WriteGate::new();
        let timeout_of = |c: &GatedStream| {
            socket2::SockRef::from(c.inner.inner())
                .tcp_user_timeout()
                .unwrap()
        };
        let mut connector = GatedConnector {
            http,
            gate: gate.clone(),
        };
        let without = connector.call(uri.clone()).await.unwrap();
        assert_eq!(
            timeout_of(&without),
            None,
            "no leader election: the kernel's default"
        );
        // The default Lease: 15 s, renewed within 10 s.
        let cfg = crate::leader::LeaderElectionConfig::new("ns", "lease");
        let client = Client::try_from(Config::new(uri.clone())).unwrap();
        let _elector = crate::leader::LeaderElector::new(client, cfg, gate.clone());
        let with = connector.call(uri).await.unwrap();
        assert_eq!(timeout_of(&with), Some(Duration::from_millis(2500)));
    }

    /// Drops the packets sent to a loopback port while it lives (iptables; needs root).
    #[cfg(target_os = "linux")]
    struct Partition(u16);

    #[cfg(target_os = "linux")]
    impl Partition {
        fn rule(&self, op: &str) -> std::io::Result<std::process::ExitStatus> {
            let port = self.0.to_string();
            std::process::Command::new("iptables")
                .args([
                    "-w", op, "INPUT", "-i", "lo", "-p", "tcp", "--dport", &port, "-j", "DROP",
                ])
                .status()
        }
    }

    #[cfg(target_os = "linux")]
    impl Drop for Partition {
        fn drop(&mut self) {
            let _ = self.rule("-D");
        }
    }

    /// The fault the user timeout is for: a write is sent while a partition drops its packets,
    /// the partition heals after the client gave up, and nothing of the write reaches the
    /// server. Without the user timeout the kernel sends it again once the partition heals.
    #[cfg(target_os = "linux")]
    #[tokio::test]
    #[ignore = "needs root and iptables; `make chaos` runs it"]
    async fn a_write_cut_off_by_a_partition_does_not_land_when_it_heals() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        // A server that answers every read and keeps every byte it read.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let received = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = received.clone();
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let seen = seen.clone();
                tokio::spawn(async move {
                    let mut buf = [0u8; 4096];
                    while let Ok(n) = conn.read(&mut buf).await {
                        if n == 0 {
                            break;
                        }
                        seen.lock().unwrap().extend_from_slice(&buf[..n]);
                        let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
                        if conn.write_all(ok).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        let config = Config::new(format!("http://127.0.0.1:{port}").parse().unwrap());
        let gate = WriteGate::new();
        gate.enforce();
        gate.open_until(std::time::Instant::now() + Duration::from_secs(60));
        // A Lease margin of 2 s: unacknowledged bytes are given up after 1 s.
        gate.set_margin(Duration::from_secs(2));
        let mut pool = write_pool(&config, &gate).unwrap();
        let patch = |body: &str| {
            let mut r = req(Method::PATCH, "/apis/example.com/v1/things/a");
            *r.body_mut() = Body::from(body.as_bytes().to_vec());
            r
        };
        // The connection is up and has carried one write.
        let first = pool.ready().await.unwrap().call(patch("{}")).await.unwrap();
        assert_eq!(first.status(), 200);
        let partition = Partition(port);
        assert!(
            partition.rule("-A").expect("running iptables").success(),
            "iptables refused the rule"
        );
        let started = std::time::Instant::now();
        // The attempt is abandoned after 3 s (a real one ends at the gate's deadline).
        let cut = tokio::time::timeout(
            Duration::from_secs(3),
            pool.ready().await.unwrap().call(patch("{\"cut\":1}")),
        )
        .await;
        let gave_up = matches!(cut, Ok(Err(_)));
        println!(
            "the cut-off write: given up by the kernel {gave_up}, after {:?}",
            started.elapsed()
        );
        drop(cut);
        // The partition heals; the kernel's retransmissions (0.2, 0.4, 0.8, 1.6, 3.2 s apart)
        // would have brought the write by now.
        drop(partition);
        tokio::time::sleep(Duration::from_secs(8)).await;
        let received = String::from_utf8_lossy(&received.lock().unwrap()).to_string();
        assert!(received.contains("{}"), "the first write arrived: {received:?}");
        assert!(
            !received.contains("cut"),
            "the cut-off write landed after the partition healed"
        );
    }

    /// An HTTP proxy that tunnels `CONNECT`s and keeps each one's request head.
    async fn connect_proxy() -> (u16, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let heads = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = heads.clone();
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let seen = seen.clone();
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    let mut byte = [0u8; 1];
                    while !head.ends_with(b"\r\n\r\n") {
                        if conn.read(&mut byte).await.unwrap_or(0) == 0 {
                            return;
                        }
                        head.push(byte[0]);
                    }
                    let head = String::from_utf8_lossy(&head).to_string();
                    let target = head.split(' ').nth(1).unwrap_or_default().to_string();
                    seen.lock().unwrap().push(head);
                    let Ok(mut upstream) = tokio::net::TcpStream::connect(target).await else {
                        return;
                    };
                    let ok = b"HTTP/1.1 200 Connection established\r\n\r\n";
                    if conn.write_all(ok).await.is_ok() {
                        let _ = tokio::io::copy_bidirectional(&mut conn, &mut upstream).await;
                    }
                });
            }
        });
        (port, heads)
    }

    #[tokio::test]
    async fn a_write_whose_gate_closed_after_its_check_sends_no_byte() {
        a_write_whose_gate_closed_after_its_check_sends_no_byte_on(None).await;
    }

    /// With a `proxy-url` (or `HTTPS_PROXY`) the writes are gated as well: the connection to
    /// the proxy is the gated one.
    #[tokio::test]
    async fn a_write_through_a_proxy_whose_gate_closed_after_its_check_sends_no_byte() {
        let (proxy, heads) = connect_proxy().await;
        let url = format!("http://us%40er:p%3Ass@127.0.0.1:{proxy}");
        a_write_whose_gate_closed_after_its_check_sends_no_byte_on(Some(url.parse().unwrap())).await;
        let heads = heads.lock().unwrap().clone();
        assert_eq!(heads.len(), 2, "one tunnel per write connection: {heads:?}");
        assert!(
            heads.iter().all(|h| h.starts_with("CONNECT 127.0.0.1:")
                // base64 of `us@er:p:ss`
                && h.lines().any(|l| l.split_once(':').is_some_and(|(name, value)| {
                    name.eq_ignore_ascii_case("proxy-authorization")
                        && value.trim() == "Basic dXNAZXI6cDpzcw=="
                }))),
            "{heads:?}"
        );
    }

    async fn a_write_whose_gate_closed_after_its_check_sends_no_byte_on(proxy: Option<http::Uri>) {
        let (port, mut closed) = counting_server().await;
        let mut config = Config::new(format!("http://127.0.0.1:{port}").parse().unwrap());
        config.proxy_url = proxy;
        let gate = WriteGate::new();
        gate.enforce();
        gate.open_until(std::time::Instant::now() + Duration::from_secs(60));
        let mut pool = write_pool(&config, &gate).unwrap();
        let patch = || {
            let mut r = req(Method::PATCH, "/apis/example.com/v1/things/a");
            *r.body_mut() = Body::from(b"{}".to_vec());
            r
        };
        let first = pool.ready().await.unwrap().call(patch()).await.unwrap();
        assert_eq!(first.status(), 200);

        // The attempt's check has passed (this call skips it); the gate closes before the
        // request's bytes leave, as when the process was frozen in between.
        gate.close();
        let Err(err) = pool.ready().await.unwrap().call(patch()).await else {
            panic!("a write went out with the gate closed");
        };
        assert!(refusal_in(&*err), "not refused by the gate: {err:?}");

        // The connection is closed with the failed write; what it carried is only the first
        // request.
        let total = tokio::time::timeout(Duration::from_secs(10), closed.recv())
            .await
            .expect("the connection should close after the refused write")
            .unwrap();
        // One request alone, on a connection of its own, for comparison.
        gate.open_until(std::time::Instant::now() + Duration::from_secs(60));
        let alone = pool.ready().await.unwrap().call(patch()).await.unwrap();
        assert_eq!(alone.status(), 200);
        drop(pool);
        let second = tokio::time::timeout(Duration::from_secs(10), closed.recv())
            .await
            .expect("the second connection should close with the pool")
            .unwrap();
        assert_eq!(
            total, second,
            "the refused request sent bytes: {total} vs one request's {second}"
        );
    }

    #[test]
    fn no_proxy_names_the_apiserver_by_host_domain_address_or_network() {
        let direct = |server: &str, no_proxy: &str| {
            let mut config = Config::new(server.parse().unwrap());
            config.proxy_url = Some("http://proxy.corp:3128".parse().unwrap());
            honour_no_proxy(&mut config, |k| (k == "NO_PROXY").then(|| no_proxy.to_string()));
            config.proxy_url.is_none()
        };
        assert!(direct("https://127.0.0.1:6443", "localhost,127.0.0.1"));
        assert!(direct("https://127.0.0.1:6443", "10.0.0.0/8, 127.0.0.0/8"));
        assert!(direct("https://api.cluster.local:6443", ".cluster.local"));
        assert!(direct("https://api.cluster.local:6443", "cluster.local"));
        assert!(direct("https://API.example.com", "api.example.com:443"));
        assert!(direct("https://[::1]:6443", "[::1]"));
        assert!(direct("https://[fd00::5]:6443", "fd00::/8"));
        assert!(direct("https://anything", "*"));
        assert!(!direct("https://127.0.0.1:6443", "localhost,10.0.0.0/8"));
        assert!(!direct("https://notcluster.local:6443", "cluster.local"));
        assert!(!direct("https://api.example.com", ""));
        assert!(!direct("https://api.example.com", "proxy.corp"));
    }

    #[test]
    fn writes_and_watches_are_told_apart() {
        assert!(
            writes(&Method::PATCH)
                && writes(&Method::POST)
                && writes(&Method::DELETE)
                && writes(&Method::PUT)
        );
        assert!(!writes(&Method::GET));
        assert!(watches(&req(
            Method::GET,
            "/api/v1/pods?watch=true&resourceVersion=1"
        )));
        assert!(watches(&req(
            Method::GET,
            "/api/v1/pods?resourceVersion=1&watch=1"
        )));
        assert!(!watches(&req(Method::GET, "/api/v1/pods?limit=500")));
        assert!(!watches(&req(Method::GET, "/api/v1/namespaces/watch=true")));
    }
}
