//! The manager's HTTP endpoints: Prometheus `/metrics`, liveness `/healthz` and readiness
//! `/readyz` (ready once every controller's caches have synced).
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::manager::{ManagerError, ManagerOptions};
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

async fn bind(what: &'static str, addr: SocketAddr) -> Result<tokio::net::TcpListener, ManagerError> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| ManagerError::Bind { what, addr, source })
}

fn spawn(listener: tokio::net::TcpListener, app: Router, shutdown: CancellationToken) -> JoinHandle<()> {
    tokio::spawn(async move {
        let r = axum::serve(listener, app)
            .with_graceful_shutdown(async move { shutdown.cancelled().await })
            .await;
        if let Err(e) = r {
            tracing::error!(error = %e, "http server failed");
        }
    })
}

pub(crate) async fn serve(
    opts: &ManagerOptions,
    metrics_state: Metrics,
    readiness: Vec<(&'static str, Arc<AtomicBool>)>,
    shutdown: CancellationToken,
) -> Result<Vec<JoinHandle<()>>, ManagerError> {
    let mut handles = Vec::new();
    if let Some(addr) = opts.metrics_addr {
        let l = bind("metrics", addr).await?;
        let app = Router::new()
            .route("/metrics", get(metrics))
            .with_state(metrics_state);
        tracing::info!(%addr, "serving /metrics");
        handles.push(spawn(l, app, shutdown.clone()));
    }
    if let Some(addr) = opts.health_addr {
        let l = bind("health probes", addr).await?;
        let app = Router::new()
            .route("/healthz", get(|| async { "ok" }))
            .route("/readyz", get(readyz))
            .with_state(Arc::new(readiness));
        tracing::info!(%addr, "serving /healthz and /readyz");
        handles.push(spawn(l, app, shutdown));
    }
    Ok(handles)
}
