//! The HTTPS servers of the operator (admission webhooks, metrics): where the certificate comes
//! from and how it is reloaded, and an accept loop that bounds what one client may cost, since
//! any Pod in the cluster can connect to them.
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use axum::Router;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::webhook::Certificate;

/// Where the serving certificate comes from.
#[derive(Clone)]
pub enum CertSource {
    /// Made in memory at start.
    Generated(Certificate),
    /// `tls.crt` and `tls.key` in a directory (a cert-manager Secret mount), reloaded when they
    /// change, so a renewed certificate is served without a restart.
    Dir(PathBuf),
    /// The latest certificate and key (PEM) sent on the channel, e.g. from the shared Secret.
    Watch(tokio::sync::watch::Receiver<(String, String)>),
}

pub(crate) fn certified_key(cert_pem: &[u8], key_pem: &[u8]) -> Result<CertifiedKey, String> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<_, _>>()
        .map_err(|e| format!("reading the certificate: {e}"))?;
    if chain.is_empty() {
        return Err("no certificate in the PEM".into());
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| format!("reading the key: {e}"))?;
    let key =
        rustls::crypto::ring::sign::any_supported_type(&key).map_err(|e| format!("unsupported key: {e}"))?;
    let ck = CertifiedKey::new(chain, key);
    // Half-written files (a certificate renewed, its key not yet) must not be served.
    match ck.keys_match() {
        Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::KeyMismatch)) => {
            Err("the key does not match the certificate".into())
        }
        _ => Ok(ck),
    }
}

#[derive(Debug)]
struct Resolver(RwLock<Arc<CertifiedKey>>);

impl ResolvesServerCert for Resolver {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.read().unwrap_or_else(|e| e.into_inner()).clone())
    }
}

fn read_dir_cert(dir: &Path) -> Result<(CertifiedKey, SystemTime), String> {
    let (c, k) = (dir.join("tls.crt"), dir.join("tls.key"));
    let read = |p: &Path| std::fs::read(p).map_err(|e| format!("reading {}: {e}", p.display()));
    let mtime = |p: &Path| {
        std::fs::metadata(p)
            .and_then(|m| m.modified())
            .unwrap_or(SystemTime::UNIX_EPOCH)
    };
    Ok((certified_key(&read(&c)?, &read(&k)?)?, mtime(&c).max(mtime(&k))))
}

/// A TLS acceptor serving the certificate of `certs`, kept current until `shutdown`: a mounted
/// directory is re-read every 10 s, a watched certificate whenever it is sent. `h2` also
/// offers HTTP/2.
pub(crate) fn acceptor(
    certs: &CertSource,
    h2: bool,
    what: &'static str,
    shutdown: &CancellationToken,
) -> Result<tokio_rustls::TlsAcceptor, String> {
    let (initial, dir) = match certs {
        CertSource::Generated(c) => (certified_key(c.cert_pem.as_bytes(), c.key_pem.as_bytes())?, None),
        CertSource::Dir(d) => {
            let (k, t) = read_dir_cert(d)?;
            (k, Some((d.clone(), t)))
        }
        CertSource::Watch(rx) => {
            let (c, k) = rx.borrow().clone();
            (certified_key(c.as_bytes(), k.as_bytes())?, None)
        }
    };
    let resolver = Arc::new(Resolver(RwLock::new(Arc::new(initial))));
    if let CertSource::Watch(rx) = certs {
        let (mut rx, resolver, shutdown) = (rx.clone(), resolver.clone(), shutdown.clone());
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    changed = rx.changed() => if changed.is_err() { return },
                }
                let (c, k) = rx.borrow_and_update().clone();
                match certified_key(c.as_bytes(), k.as_bytes()) {
                    Ok(ck) => {
                        *resolver.0.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(ck);
                        tracing::info!(server = what, "serving the renewed certificate");
                    }
                    Err(e) => tracing::warn!(server = what, error = %e, "certificate not reloaded"),
                }
            }
        });
    }
    if let Some((dir, mut seen)) = dir {
        let (resolver, shutdown) = (resolver.clone(), shutdown.clone());
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_secs(10)) => {}
                }
                match read_dir_cert(&dir) {
                    Ok((k, t)) if t > seen => {
                        *resolver.0.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(k);
                        seen = t;
                        tracing::info!(server = what, dir = %dir.display(), "reloaded the certificate");
                    }
                    Ok(_) => {}
                    Err(e) => tracing::warn!(server = what, error = %e, "certificate not reloaded"),
                }
            }
        });
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_no_client_auth()
        .with_cert_resolver(resolver);
    config.alpn_protocols = match h2 {
        true => vec![b"h2".to_vec(), b"http/1.1".to_vec()],
        false => vec![b"http/1.1".to_vec()],
    };
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}

/// What one connection may cost a server.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// Connections served at once; further ones wait in the listen backlog.
    pub connections: usize,
    /// A TLS handshake longer than this is dropped.
    pub handshake: Duration,
    /// Request headers must arrive within this (also ends idle keep-alive connections).
    pub headers: Duration,
    /// A connection this old is closed after its current request, so no client keeps a slot.
    pub age: Duration,
    /// How long that last request may still take.
    pub drain: Duration,
    /// After `shutdown`, how long the server still accepts and answers, each answer with
    /// `Connection: close`: the client's next request then opens a connection (to another
    /// replica, once the Service has dropped this one) instead of meeting one closed under it.
    pub grace: Duration,
    /// Serve HTTP/2 as well as HTTP/1.1.
    pub http2: bool,
}

/// Pause after a failed `accept` (out of file descriptors, ...), doubling up to 1 s.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(10);

/// Serves `app` over TLS on `listener` until `shutdown` and its grace period, within `limits`;
/// the task ends once every connection has (each given `drain` after the grace period).
pub(crate) fn serve(
    what: &'static str,
    listener: tokio::net::TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    app: Router,
    limits: Limits,
    shutdown: CancellationToken,
) -> JoinHandle<()> {
    let slots = Arc::new(tokio::sync::Semaphore::new(limits.connections));
    let closing = CancellationToken::new();
    let stopping = shutdown.clone();
    let app = app.layer(axum::middleware::from_fn(
        move |req: axum::extract::Request, next: axum::middleware::Next| {
            let stopping = stopping.clone();
            async move {
                let http1 = req.version() <= axum::http::Version::HTTP_11;
                let mut resp = next.run(req).await;
                if http1 && stopping.is_cancelled() {
                    resp.headers_mut().insert(
                        axum::http::header::CONNECTION,
                        axum::http::HeaderValue::from_static("close"),
                    );
                }
                resp
            }
        },
    ));
    {
        let (shutdown, closing) = (shutdown.clone(), closing.clone());
        tokio::spawn(async move {
            shutdown.cancelled().await;
            tokio::time::sleep(limits.grace).await;
            closing.cancel();
        });
    }
    tokio::spawn(async move {
        let mut backoff = ACCEPT_BACKOFF;
        loop {
            let permit = tokio::select! {
                _ = closing.cancelled() => break,
                p = slots.clone().acquire_owned() => match p {
                    Ok(p) => p,
                    Err(_) => break,
                },
            };
            let (stream, _) = tokio::select! {
                _ = closing.cancelled() => break,
                r = listener.accept() => match r {
                    Ok(s) => {
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
            // A connection accepted during the grace period is answered once (with
            // `Connection: close`) however late its request comes within the header timeout:
            // its client sent the request already, and closing it unanswered would fail it.
            let closes = (!shutdown.is_cancelled()).then(|| closing.clone());
            tokio::spawn(connection(
                what,
                stream,
                acceptor.clone(),
                app.clone(),
                limits,
                closes,
                permit,
            ));
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
            tokio::spawn(connection(
                what,
                stream,
                acceptor.clone(),
                app.clone(),
                limits,
                None,
                permit,
            ));
        }
        drop(listener);
        // Every connection holds a slot until it ends.
        let all = u32::try_from(limits.connections).unwrap_or(u32::MAX);
        let _ = tokio::time::timeout(limits.drain, slots.acquire_many(all)).await;
    })
}

/// Serves one connection within `limits` until it ends, is too old, or `closing` fires (then
/// the request in flight is answered with `Connection: close` and an idle connection closed
/// now, while the process still runs, rather than dying with it).
async fn connection(
    what: &'static str,
    stream: tokio::net::TcpStream,
    acceptor: tokio_rustls::TlsAcceptor,
    app: Router,
    limits: Limits,
    closing: Option<CancellationToken>,
    permit: tokio::sync::OwnedSemaphorePermit,
) {
    let _permit = permit;
    let tls = match tokio::time::timeout(limits.handshake, acceptor.accept(stream)).await {
        Ok(Ok(t)) => t,
        Ok(Err(e)) => {
            tracing::debug!(server = what, error = %e, "TLS handshake failed");
            return;
        }
        Err(_) => {
            tracing::debug!(server = what, "TLS handshake timed out");
            return;
        }
    };
    let svc = hyper_util::service::TowerToHyperService::new(app);
    let mut builder = hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new());
    builder
        .http1()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(limits.headers);
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
    let conn = builder.serve_connection(hyper_util::rt::TokioIo::new(tls), svc);
    tokio::pin!(conn);
    let closing = async {
        match &closing {
            Some(c) => c.cancelled().await,
            None => std::future::pending().await,
        }
    };
    let ended = tokio::select! {
        r = conn.as_mut() => r,
        _ = async {
            tokio::select! {
                _ = tokio::time::sleep(limits.age) => {}
                _ = closing => {}
            }
        } => {
            conn.as_mut().graceful_shutdown();
            match tokio::time::timeout(limits.drain, conn.as_mut()).await {
                Ok(r) => r,
                Err(_) => Ok(()),
            }
        }
    };
    if let Err(e) = ended {
        tracing::debug!(server = what, error = %e, "connection ended with an error");
    }
}
