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
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Method, Request, Response};
use kube::client::{Body, ClientBuilder, DynBody};
use kube::{Client, Config};
use tower::buffer::BufferLayer;
use tower::retry::RetryLayer;
use tower::{BoxError, Layer, Service};

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

/// Builds the controllers' client from `config`: kube's stack without its own retry layer,
/// then [`Attempt`] (the gate and the deadline), then kube's server-aware retry policy.
pub fn build(
    config: Config,
    gate: &WriteGate,
    request_timeout: Duration,
    metrics: &Metrics,
) -> kube::Result<Client> {
    let mut config = config;
    config.default_retry = false;
    let builder = ClientBuilder::try_from(config)?;
    let attempts = AttemptLayer {
        gate: gate.clone(),
        timeout: request_timeout,
        metrics: metrics.clone(),
    };
    Ok(builder
        .with_layer(&attempts)
        .with_layer(&BufferLayer::new(1024))
        .with_layer(&RetryLayer::new(kube::client::retry::RetryPolicy::server_retry()))
        .build())
}

/// Makes [`Attempt`]s.
#[derive(Clone)]
pub struct AttemptLayer {
    gate: WriteGate,
    timeout: Duration,
    metrics: Metrics,
}

impl<S> Layer<S> for AttemptLayer {
    type Service = Attempt<S>;
    fn layer(&self, inner: S) -> Attempt<S> {
        Attempt {
            inner,
            gate: self.gate.clone(),
            timeout: self.timeout,
            metrics: self.metrics.clone(),
        }
    }
}

/// One attempt of one request: gated if it writes, bounded unless it watches.
pub struct Attempt<S> {
    inner: S,
    gate: WriteGate,
    timeout: Duration,
    metrics: Metrics,
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
        let fut = self.inner.call(req);
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
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = source {
        if e.is::<NotLeader>() {
            return true;
        }
        source = e.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(method: Method, uri: &str) -> Request<Body> {
        let mut r = Request::new(Body::empty());
        *r.method_mut() = method;
        *r.uri_mut() = uri.parse().expect("a valid uri");
        r
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
