//! The accept loop of the operator's HTTPS servers (admission webhooks, metrics). Any Pod in
//! the cluster can connect to them, so it bounds what one client may cost; and their real
//! clients (the apiserver, Prometheus) keep connections alive between requests, so it never
//! closes a connection such a client may be about to reuse: an HTTP/1.1 request written into a
//! connection the server has just closed fails (`broken pipe`), and the apiserver does not
//! retry an admission or conversion request.
use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// What one connection may cost a server.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// Connections served at once. When all are taken, a new connection takes the slot of the
    /// oldest one that has had no request answered, if open for [`UNPROVEN`] (with TLS; else
    /// [`UNPROVEN_PLAIN`]), or else of the
    /// one idle longest, if idle for [`Limits::reclaim`]; otherwise it waits (then in the
    /// listen backlog).
    pub connections: usize,
    /// A TLS handshake longer than this is dropped.
    pub handshake: Duration,
    /// A request's headers must arrive within this of its first byte (HTTP/1), so a slow sender
    /// holds a connection slot only briefly.
    pub headers: Duration,
    /// A connection with no request for this long is closed. Longer than the 90 s after which
    /// Go's HTTP clients (the apiserver's, Prometheus's) drop an idle connection themselves, so
    /// they close first and never write into a connection closed under them.
    pub idle: Duration,
    /// A connection idle this long gives its slot up to a new one when all are taken. Closing
    /// an idle connection may still meet its client reusing it; one its client uses often
    /// (the apiserver's, during a flood of other connections) is never idle this long.
    pub reclaim: Duration,
    /// A connection this old answers its next request with `Connection: close` (HTTP/2: is
    /// told to go away), so no client keeps a slot, or one replica, for ever.
    pub age: Duration,
    /// How long a request in flight may still take once its connection is closing.
    pub drain: Duration,
    /// After `shutdown`, how long the server still accepts and answers, each answer with
    /// `Connection: close`: the client's next request then opens a connection (to another
    /// replica, once the Service has dropped this one) instead of meeting one closed under it.
    pub grace: Duration,
    /// Serve HTTP/2 as well as HTTP/1.1.
    pub http2: bool,
}

/// No request for this long closes a connection: see [`Limits::idle`].
pub(crate) const IDLE: Duration = Duration::from_secs(120);

/// Idle this long, a connection gives its slot up when all are taken: see [`Limits::reclaim`].
pub(crate) const RECLAIM: Duration = Duration::from_secs(30);

/// A connection that has not had a request answered yet (its TLS handshake or first request
/// still under way, or silent since its handshake) this long gives its slot up when all are
/// taken: a real client's handshake and request take milliseconds, and silent or trickling
/// connections would otherwise hold every slot for the handshake or idle timeout. A
/// connection the apiserver dialed and pooled unused is such a one too, and goes first.
pub(crate) const UNPROVEN: Duration = Duration::from_secs(1);

/// [`UNPROVEN`] without TLS (the probe port, plain `/metrics`): a real client's request
/// arrives with its connection, and the kubelet gives a probe 1 s in all.
pub(crate) const UNPROVEN_PLAIN: Duration = Duration::from_millis(100);

/// Pause after a failed `accept` (out of file descriptors, ...), doubling up to 1 s.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(10);

/// What the server knows of one connection: whether a request is being answered, or on its
/// way (bytes arrived since the last answer), and since when.
struct Activity {
    /// Requests being answered.
    inflight: AtomicUsize,
    /// Bytes arrived since the connection was last idle: a request is on its way.
    reading: AtomicBool,
    /// When the last answer was given, or when the bytes of the next request began.
    since: Mutex<Instant>,
    /// Answer the next request with `Connection: close`.
    close_next: AtomicBool,
    /// A request has been answered (or is being): the client is a real one.
    proven: AtomicBool,
    /// When the connection was accepted.
    opened: Instant,
    /// Any of the above changed.
    changed: Notify,
    /// The server needs this connection's slot: close it if it is idle.
    reclaim: Notify,
}

impl Activity {
    fn new() -> Self {
        Activity {
            inflight: AtomicUsize::new(0),
            reading: AtomicBool::new(false),
            since: Mutex::new(Instant::now()),
            close_next: AtomicBool::new(false),
            proven: AtomicBool::new(false),
            opened: Instant::now(),
            changed: Notify::new(),
            reclaim: Notify::new(),
        }
    }

    fn since(&self) -> Instant {
        *self.since.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn set_since(&self, at: Instant) {
        *self.since.lock().unwrap_or_else(|e| e.into_inner()) = at;
    }

    /// Bytes arrived: the first ones after an answer start the header timeout.
    fn bytes_arrived(&self) {
        if self.inflight.load(Ordering::Acquire) == 0 && !self.reading.swap(true, Ordering::AcqRel) {
            self.set_since(Instant::now());
            self.changed.notify_one();
        }
    }

    fn begin(&self) {
        self.proven.store(true, Ordering::Release);
        self.inflight.fetch_add(1, Ordering::AcqRel);
        self.reading.store(false, Ordering::Release);
        self.changed.notify_one();
    }

    fn end(&self) {
        self.set_since(Instant::now());
        self.inflight.fetch_sub(1, Ordering::AcqRel);
        self.changed.notify_one();
    }

    fn idle(&self) -> bool {
        self.inflight.load(Ordering::Acquire) == 0
    }

    /// No request answered yet: see [`UNPROVEN`].
    fn unproven(&self) -> bool {
        !self.proven.load(Ordering::Acquire)
    }

    /// Answering nothing, and no request on its way.
    fn quiet(&self) -> bool {
        self.idle() && !self.reading.load(Ordering::Acquire)
    }

    /// When a connection answering nothing times out, and whether that is the header timeout
    /// (a request on its way, HTTP/1) rather than the idle one.
    fn timeout(&self, http2: bool, limits: &Limits) -> Option<(Instant, bool)> {
        if !self.idle() {
            return None;
        }
        let headers = !http2 && self.reading.load(Ordering::Acquire);
        let limit = if headers { limits.headers } else { limits.idle };
        Some((self.since() + limit, headers))
    }
}

/// A stream that reports arriving bytes to its connection's [`Activity`].
struct Tracked<S> {
    io: S,
    activity: Arc<Activity>,
}

impl<S: AsyncRead + Unpin> AsyncRead for Tracked<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.io).poll_read(cx, buf);
        if buf.filled().len() > before {
            this.activity.bytes_arrived();
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Tracked<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

/// The connections being served, so that a new one can take the slot of an idle one.
#[derive(Default)]
struct Connections {
    next: AtomicU64,
    open: Mutex<HashMap<u64, Arc<Activity>>>,
}

impl Connections {
    fn add(self: &Arc<Self>, activity: Arc<Activity>) -> Registered {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.open
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, activity);
        Registered(self.clone(), id)
    }

    /// Asks one connection to close: the oldest that has had no request answered, if open for
    /// `unproven`; else the one quiet longest, if quiet for `after`.
    fn reclaim_one(&self, unproven: Duration, after: Duration) {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let pick = match open
            .iter()
            .filter(|(_, a)| a.unproven())
            .min_by_key(|(_, a)| a.opened)
        {
            Some((id, a)) if a.opened.elapsed() >= unproven => Some(*id),
            _ => open
                .iter()
                .filter(|(_, a)| a.quiet())
                .map(|(id, a)| (*id, a.since()))
                .min_by_key(|(_, since)| *since)
                .filter(|(_, since)| since.elapsed() >= after)
                .map(|(id, _)| id),
        };
        if let Some(a) = pick.and_then(|id| open.remove(&id)) {
            a.reclaim.notify_one();
        }
    }
}

/// Removes a connection from [`Connections`] when it ends.
struct Registered(Arc<Connections>, u64);

impl Registered {
    /// Puts a connection asked for its slot back among the reclaimable ones: a request began
    /// on it meanwhile, so it kept its slot.
    fn restore(&self, activity: &Arc<Activity>) {
        self.0
            .open
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(self.1, activity.clone());
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.0
            .open
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.1);
    }
}

/// Serves `app` over TLS (plain HTTP without an `acceptor`: the probe port) on `listener`
/// until `shutdown` and its grace period, within `limits`; the task ends once every connection
/// has (each given `drain` after the grace period).
pub(crate) fn serve(
    what: &'static str,
    listener: tokio::net::TcpListener,
    acceptor: Option<tokio_rustls::TlsAcceptor>,
    app: Router,
    limits: Limits,
    shutdown: CancellationToken,
) -> JoinHandle<()> {
    let slots = Arc::new(tokio::sync::Semaphore::new(limits.connections));
    let unproven = if acceptor.is_some() {
        UNPROVEN
    } else {
        UNPROVEN_PLAIN
    };
    let conns = Arc::new(Connections::default());
    let closing = CancellationToken::new();
    {
        let (shutdown, closing) = (shutdown.clone(), closing.clone());
        tokio::spawn(async move {
            shutdown.cancelled().await;
            tokio::time::sleep(limits.grace).await;
            closing.cancel();
        });
    }
    let server = Server {
        what,
        acceptor,
        app,
        limits,
        conns,
        stopping: shutdown.clone(),
    };
    tokio::spawn(async move {
        let mut backoff = ACCEPT_BACKOFF;
        'accept: loop {
            let stream = tokio::select! {
                _ = closing.cancelled() => break,
                r = listener.accept() => match r {
                    Ok((s, _)) => {
                        backoff = ACCEPT_BACKOFF;
                        s
                    }
                    Err(e) => {
                        tracing::warn!(server = what, error = %e, "accepting a connection failed");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_secs(1));
                        continue;
                    }
                },
            };
            // All slots taken: the connection idle longest gives its slot up if idle long
            // enough (checked again every 100 ms); otherwise the new one waits.
            let permit = loop {
                match slots.clone().try_acquire_owned() {
                    Ok(p) => break p,
                    Err(tokio::sync::TryAcquireError::Closed) => break 'accept,
                    Err(tokio::sync::TryAcquireError::NoPermits) => {}
                }
                server.conns.reclaim_one(unproven, limits.reclaim);
                tokio::select! {
                    _ = closing.cancelled() => break 'accept,
                    p = tokio::time::timeout(Duration::from_millis(100), slots.clone().acquire_owned()) => {
                        if let Ok(Ok(p)) = p {
                            break p;
                        }
                    }
                }
            };
            // A connection accepted during the grace period is answered once (with
            // `Connection: close`) however late its request comes within the header timeout:
            // its client sent the request already, and closing it unanswered would fail it.
            let closes = (!shutdown.is_cancelled()).then(|| closing.clone());
            tokio::spawn(server.clone().connection(stream, closes, permit));
        }
        // Connections the kernel has completed but not handed over yet would be reset with
        // the listener, and a request may already be on its way in them: take them too (each
        // answered once, with `Connection: close`).
        while let Ok(Ok((stream, _))) =
            tokio::time::timeout(Duration::from_millis(20), listener.accept()).await
        {
            let Ok(permit) = slots.clone().try_acquire_owned() else {
                break;
            };
            tokio::spawn(server.clone().connection(stream, None, permit));
        }
        drop(listener);
        // Every connection holds a slot until it ends.
        let all = u32::try_from(limits.connections).unwrap_or(u32::MAX);
        let _ = tokio::time::timeout(limits.drain, slots.acquire_many(all)).await;
    })
}

/// What every connection of one server shares.
#[derive(Clone)]
struct Server {
    what: &'static str,
    acceptor: Option<tokio_rustls::TlsAcceptor>,
    app: Router,
    limits: Limits,
    conns: Arc<Connections>,
    /// After this, every HTTP/1 answer says `Connection: close`.
    stopping: CancellationToken,
}

impl Server {
    /// Serves one connection within the limits until it ends, times out, is reclaimed, or
    /// `closing` fires (then the request in flight is answered with `Connection: close` and an
    /// idle connection closed now, while the process still runs, rather than dying with it).
    async fn connection(
        self,
        stream: tokio::net::TcpStream,
        closing: Option<CancellationToken>,
        permit: tokio::sync::OwnedSemaphorePermit,
    ) {
        let _permit = permit;
        let (what, limits) = (self.what, self.limits);
        let activity = Arc::new(Activity::new());
        // Registered from the start: a connection still handshaking can be asked for its slot.
        // Not one accepted once the server stops: it is promised an answer (see `serve`).
        let registered = closing.is_some().then(|| self.conns.add(activity.clone()));
        let stream = Tracked {
            io: stream,
            activity: activity.clone(),
        };
        let Some(acceptor) = self.acceptor.clone() else {
            // Plain HTTP: the first request's headers are due as a TLS handshake would be.
            return self
                .serve_io(stream, false, true, activity, closing, registered.as_ref())
                .await;
        };
        let handshake = tokio::time::timeout(limits.handshake, acceptor.accept(stream));
        let tls = tokio::select! {
            r = handshake => match r {
                Ok(Ok(t)) => t,
                Ok(Err(e)) => {
                    tracing::debug!(server = what, error = %e, "TLS handshake failed");
                    return;
                }
                Err(_) => {
                    tracing::debug!(server = what, "TLS handshake timed out");
                    return;
                }
            },
            _ = activity.reclaim.notified() => {
                tracing::debug!(server = what, "a connection still handshaking gives its slot up");
                return;
            }
        };
        let http2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
        // Accepted while the server stops, it is promised one answer and then closes: its
        // request is due within the header timeout, so a silent one cannot hold the stop up.
        let first_due = closing.is_none();
        self.serve_io(tls, http2, first_due, activity, closing, registered.as_ref())
            .await
    }

    /// Serves the HTTP of one connection (after its TLS handshake, if any); see
    /// [`Server::connection`].
    ///
    /// With `first_due`, the first request's headers are due within the header timeout from
    /// now; without, the connection waits for its first request as a kept-alive one waits for
    /// its next (until the idle timeout, or until all slots are taken: it has proven nothing).
    /// A TLS connection waits (unless accepted while the server stops): Go's HTTP client (the
    /// apiserver's) pools a connection it dialed for a request that another connection served
    /// meanwhile, and may send its first request on it much later. A server that cuts it on
    /// its own schedule races that request, which fails (a POST half written is not retried:
    /// `write: broken pipe`), as an admission did; the client's own idle timeout (90 s) ends
    /// such a connection before the server's (120 s).
    async fn serve_io<IO>(
        self,
        io: IO,
        http2: bool,
        first_due: bool,
        activity: Arc<Activity>,
        closing: Option<CancellationToken>,
        registered: Option<&Registered>,
    ) where
        IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let (what, limits) = (self.what, self.limits);
        activity.set_since(Instant::now());
        activity.reading.store(first_due, Ordering::Release);

        let svc = {
            let (app, activity, stopping) = (self.app.clone(), activity.clone(), self.stopping.clone());
            hyper::service::service_fn(move |req: axum::http::Request<hyper::body::Incoming>| {
                let (app, activity, stopping) = (app.clone(), activity.clone(), stopping.clone());
                async move {
                    activity.begin();
                    let mut resp = tower::ServiceExt::oneshot(app, req).await;
                    if let Ok(resp) = &mut resp
                        && !http2
                        && (stopping.is_cancelled() || activity.close_next.load(Ordering::Acquire))
                    {
                        resp.headers_mut().insert(
                            axum::http::header::CONNECTION,
                            axum::http::HeaderValue::from_static("close"),
                        );
                    }
                    activity.end();
                    resp
                }
            })
        };
        let mut builder = hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new());
        // Header and idle timeouts are kept below: hyper's header timeout also runs while a
        // keep-alive connection is idle, and would close it under a client about to reuse it.
        builder
            .http1()
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(None);
        builder
            .http2()
            .timer(hyper_util::rt::TokioTimer::new())
            .keep_alive_interval(Some(limits.headers))
            .keep_alive_timeout(limits.handshake)
            .max_concurrent_streams(16);
        let builder = if limits.http2 {
            builder
        } else {
            builder.http1_only()
        };
        let conn = builder.serve_connection(hyper_util::rt::TokioIo::new(io), svc);
        tokio::pin!(conn);
        let closing = async {
            match &closing {
                Some(c) => c.cancelled().await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(closing);
        let age_at = activity.opened + limits.age;
        let (mut aged, mut closed) = (false, false);
        let exit = loop {
            // Closing, an HTTP/1 connection whose next request has begun to arrive answers it
            // first (with `Connection: close`): closing it now would fail a request its client
            // has already sent. A quiet one is closed; HTTP/2 is told to go away.
            if closed && (http2 || activity.quiet()) {
                tracing::debug!(server = what, "closing a quiet connection: the server stops");
                break Exit::Close;
            }
            let timeout = activity.timeout(http2, &limits);
            let wait = async {
                match timeout {
                    Some((at, _)) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                r = conn.as_mut() => break Exit::Ended(r),
                _ = activity.changed.notified() => {}
                _ = activity.reclaim.notified() => {
                    if activity.unproven() {
                        tracing::debug!(server = what, "a connection with no request yet gives its slot up");
                        break Exit::Cut;
                    }
                    if activity.quiet() {
                        tracing::debug!(server = what, "an idle connection gives its slot up");
                        break Exit::Close;
                    }
                    if let Some(r) = registered {
                        r.restore(&activity);
                    }
                }
                _ = &mut closing, if !closed => closed = true,
                _ = tokio::time::sleep_until(age_at), if !aged => {
                    aged = true;
                    if http2 {
                        break Exit::Close;
                    }
                    activity.close_next.store(true, Ordering::Release);
                }
                _ = wait => match activity.timeout(http2, &limits) {
                    Some((at, headers)) if Instant::now() >= at => {
                        if headers {
                            tracing::debug!(server = what, "request headers timed out");
                            break Exit::Cut;
                        }
                        tracing::debug!(server = what, "closing a connection idle for the idle timeout");
                        break Exit::Close;
                    }
                    _ => {}
                },
            }
        };
        let ended = match exit {
            Exit::Ended(r) => r,
            Exit::Cut => Ok(()),
            Exit::Close => {
                conn.as_mut().graceful_shutdown();
                tokio::time::timeout(limits.drain, conn.as_mut())
                    .await
                    .unwrap_or(Ok(()))
            }
        };
        if let Err(e) = ended {
            tracing::debug!(server = what, error = %e, "connection ended with an error");
        }
    }
}

/// How a connection's serving ends.
enum Exit<E> {
    /// The client closed it, or it failed.
    Ended(Result<(), E>),
    /// Close it once the request in flight, if any, is answered (HTTP/2: go away).
    Close,
    /// Drop it now: its request is too slow.
    Cut,
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use rustls::pki_types::pem::PemObject;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    type Tls = tokio_rustls::client::TlsStream<tokio::net::TcpStream>;

    /// A TLS client connection to `port` that trusts `ca`.
    pub(crate) async fn connect_tls(port: u16, ca: &str) -> std::io::Result<Tls> {
        let mut roots = rustls::RootCertStore::empty();
        let der = rustls::pki_types::CertificateDer::from_pem_slice(ca.as_bytes())
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        roots.add(der).map_err(|e| std::io::Error::other(e.to_string()))?;
        let config =
            rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .map_err(|e| std::io::Error::other(e.to_string()))?
                .with_root_certificates(roots)
                .with_no_client_auth();
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        let name = rustls::pki_types::ServerName::try_from("127.0.0.1").map_err(std::io::Error::other)?;
        tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(name, tcp)
            .await
    }

    /// Sends a keep-alive GET on `tls` and reads its whole answer (headers and body).
    async fn get(tls: &mut Tls) -> std::io::Result<String> {
        tls.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await?;
        // Else the request may wait in the TLS buffer: see `opkit_testenv::https_get`.
        tls.flush().await?;
        let mut out = Vec::new();
        let mut buf = [0u8; 1024];
        loop {
            if let Some(end) = out.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&out[..end]).to_lowercase();
                let len: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap_or(0);
                if out.len() >= end + 4 + len {
                    return Ok(String::from_utf8_lossy(&out).into_owned());
                }
            }
            let n = tls.read(&mut buf).await?;
            if n == 0 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!("closed after {:?}", String::from_utf8_lossy(&out)),
                ));
            }
            out.extend_from_slice(&buf[..n]);
        }
    }

    /// Waits (at most `within`) for the server to close `tls`; how long that took.
    async fn closed(tls: &mut Tls, within: Duration) -> Duration {
        let started = Instant::now();
        let mut buf = [0u8; 64];
        let read = tokio::time::timeout(within, tls.read(&mut buf))
            .await
            .expect("the server closed the connection in time");
        assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
        started.elapsed()
    }

    /// A server answering `GET /` with `ok`, within `limits`, on a free port.
    async fn server(limits: Limits) -> (String, u16, CancellationToken) {
        let cert = crate::tls::self_signed(&["127.0.0.1".into()]).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let shutdown = CancellationToken::new();
        let acceptor = crate::tls::acceptor(
            &crate::tls::CertSource::Generated(cert.clone()),
            false,
            "test",
            &shutdown,
        )
        .unwrap();
        let app = Router::new().route("/", axum::routing::get(|| async { "ok" }));
        serve("test", listener, Some(acceptor), app, limits, shutdown.clone());
        (cert.ca_pem, port, shutdown)
    }

    /// A server within `limits` and a connection to it kept alive after one answered request.
    async fn kept_alive(limits: Limits) -> (u16, String, CancellationToken, Tls) {
        let (ca, port, shutdown) = server(limits).await;
        let mut tls = connect_tls(port, &ca).await.unwrap();
        assert!(get(&mut tls).await.unwrap().starts_with("HTTP/1.1 200"));
        (port, ca, shutdown, tls)
    }

    fn limits() -> Limits {
        Limits {
            connections: 4,
            handshake: Duration::from_secs(5),
            headers: Duration::from_secs(1),
            idle: Duration::from_secs(3),
            reclaim: Duration::from_secs(2),
            age: Duration::from_secs(120),
            drain: Duration::from_secs(5),
            grace: Duration::ZERO,
            http2: false,
        }
    }

    /// A new client's request is answered within `within`; how long that took.
    async fn answered_within(port: u16, ca: &str, within: Duration) -> Duration {
        let started = Instant::now();
        let answered = tokio::time::timeout(within, async {
            let mut tls = connect_tls(port, ca).await?;
            get(&mut tls).await
        })
        .await
        .expect("answered long before the idle timeout")
        .unwrap();
        assert!(answered.starts_with("HTTP/1.1 200"), "{answered}");
        started.elapsed()
    }

    /// After longer than the header timeout a request on `tls` is answered, and the server
    /// closes `tls` only once idle for the idle timeout.
    async fn served_late_and_closed_when_idle(tls: &mut Tls) {
        tokio::time::sleep(limits().headers + Duration::from_millis(700)).await;
        let again = get(tls).await.expect("the connection was kept");
        assert!(again.starts_with("HTTP/1.1 200"), "{again}");
        let took = closed(tls, limits().idle * 2).await;
        assert!(
            took >= limits().idle - Duration::from_millis(300),
            "closed after {took:?}"
        );
    }

    #[tokio::test]
    async fn a_keep_alive_connection_idle_past_the_header_timeout_is_still_served() {
        let (_, _, shutdown, mut tls) = kept_alive(limits()).await;
        // Idle longer than the header timeout, as the apiserver's pooled connections are
        // between admissions.
        served_late_and_closed_when_idle(&mut tls).await;
        shutdown.cancel();
    }

    #[tokio::test]
    async fn a_request_whose_headers_come_too_slowly_is_cut_at_the_header_timeout() {
        let (port, ca, shutdown, mut tls) = kept_alive(limits()).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        tls.write_all(b"GET / HTTP/1.1\r\nHo").await.unwrap();
        tls.flush().await.unwrap();
        let took = closed(&mut tls, limits().headers * 3).await;
        assert!(
            took >= limits().headers - Duration::from_millis(300),
            "closed after {took:?}"
        );
        // A new connection that sends nothing after its handshake is not: as the apiserver's
        // pooled connections that have not carried a request yet, it is served later, and
        // closed only once idle for the idle timeout.
        let mut fresh = connect_tls(port, &ca).await.unwrap();
        served_late_and_closed_when_idle(&mut fresh).await;
        // One that never sends a request lasts the idle timeout too.
        let mut silent = connect_tls(port, &ca).await.unwrap();
        let took = closed(&mut silent, limits().idle * 2).await;
        assert!(
            took >= limits().idle - Duration::from_millis(300),
            "closed after {took:?}"
        );
        shutdown.cancel();
    }

    #[tokio::test]
    async fn connections_silent_since_their_handshake_give_their_slots_up_to_a_new_client() {
        // Neither the header, idle nor reclaim time frees a slot within the test: only their
        // having answered nothing does.
        let limits = Limits {
            headers: Duration::from_secs(30),
            idle: Duration::from_secs(60),
            reclaim: Duration::from_secs(60),
            ..limits()
        };
        let (ca, port, shutdown) = server(limits).await;
        // Every slot held by a connection that completed its handshake and sent nothing (kept
        // until the idle timeout while slots are free, see above).
        let mut held = Vec::new();
        for _ in 0..limits.connections {
            held.push(connect_tls(port, &ca).await.unwrap());
        }
        let waited = answered_within(port, &ca, UNPROVEN * 5).await;
        assert!(waited < UNPROVEN * 3, "answered after {waited:?}");
        closed(&mut held[0], Duration::from_secs(5)).await;
        shutdown.cancel();
    }

    #[tokio::test]
    async fn a_new_client_takes_the_slot_of_a_connection_idle_long_enough() {
        let limits = Limits {
            idle: Duration::from_secs(60),
            ..limits()
        };
        let (ca, port, shutdown) = server(limits).await;
        // Every slot held by a kept-alive connection, the first idle longest.
        let mut held = Vec::new();
        for _ in 0..limits.connections {
            let mut tls = connect_tls(port, &ca).await.unwrap();
            assert!(get(&mut tls).await.unwrap().starts_with("HTTP/1.1 200"));
            held.push(tls);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let waited = answered_within(port, &ca, limits.reclaim * 3).await;
        // Not before the oldest had been idle for the reclaim time: a connection its client
        // is using is not taken from it.
        assert!(
            waited >= limits.reclaim - Duration::from_millis(400),
            "{waited:?}"
        );
        // The one that gave its slot up is the oldest; the others still serve.
        closed(&mut held[0], Duration::from_secs(5)).await;
        for tls in &mut held[2..] {
            assert!(get(tls).await.unwrap().starts_with("HTTP/1.1 200"));
        }
        shutdown.cancel();
    }

    #[tokio::test]
    async fn a_request_arriving_when_the_server_closes_is_answered_first() {
        let (_, _, shutdown, mut tls) = kept_alive(limits()).await;
        // The client has begun its next request on the kept-alive connection...
        tls.write_all(b"GET / HTTP/1.1\r\nHo").await.unwrap();
        tls.flush().await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        // ...when the server stops (no grace period here): it closes its idle connections.
        shutdown.cancel();
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut rest = Vec::new();
        let answered = async {
            tls.write_all(b"st: x\r\n\r\n").await?;
            tls.flush().await?;
            tls.read_to_end(&mut rest).await
        };
        let _ = tokio::time::timeout(Duration::from_secs(5), answered).await;
        let rest = String::from_utf8_lossy(&rest).to_lowercase();
        assert!(rest.starts_with("http/1.1 200"), "not answered: {rest:?}");
        assert!(rest.contains("connection: close"), "{rest}");
    }

    #[tokio::test]
    async fn an_old_connection_is_not_closed_while_idle_but_its_next_answer_closes_it() {
        let limits = Limits {
            age: Duration::from_secs(1),
            ..limits()
        };
        let (ca, port, shutdown) = server(limits).await;
        let mut tls = connect_tls(port, &ca).await.unwrap();
        let first = get(&mut tls).await.unwrap();
        assert!(!first.to_lowercase().contains("connection: close"), "{first}");
        // Past its age while idle: a client may be about to reuse it, so it stays open...
        tokio::time::sleep(limits.age + Duration::from_millis(500)).await;
        let last = get(&mut tls).await.expect("kept open past its age while idle");
        // ...and the next answer tells the client to open a new one.
        assert!(last.to_lowercase().contains("connection: close"), "{last}");
        closed(&mut tls, Duration::from_secs(2)).await;
        shutdown.cancel();
    }
}
