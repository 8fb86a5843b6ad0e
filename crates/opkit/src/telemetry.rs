//! Logs, and traces over OTLP. Traces are off unless `OTEL_EXPORTER_OTLP_ENDPOINT` (or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set, as the OpenTelemetry SDKs of every language
//! do. A trace is a `reconcile` span (info level: its fields also label the log lines) with
//! `observe`, `plan`/`cleanup` and one span per write (`apply`, `prune`, `status`,
//! `finalizer`, `delete`) under it; those are at debug level under the `opkit` target, so
//! without an exporter they are filtered out before they are built. With one, the reconcile's
//! log lines carry its `trace_id`, and the JSON logs print it.
//!
//! The exporter speaks OTLP/HTTP with protobuf bodies (`http://collector:4318`; `https` is not
//! supported by its client) and honours the SDK's standard variables: `OTEL_SERVICE_NAME`
//! (default: the operator's name), `OTEL_EXPORTER_OTLP_HEADERS`, `OTEL_EXPORTER_OTLP_TIMEOUT`
//! and the `_TRACES_` variants.
#[cfg(feature = "otel")]
use opentelemetry::trace::TracerProvider as _;
#[cfg(feature = "otel")]
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::Layer;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// How log lines are printed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// One human-readable line per event.
    Text,
    /// One JSON object per line (with the fields of the spans it happened in).
    Json,
}

/// The trace exporter, if any: [`Telemetry::flush`] it before the process ends.
pub struct Telemetry {
    #[cfg(feature = "otel")]
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Sends what is buffered and stops the exporter, for at most 5 s (a collector that does
    /// not answer must not hold the process past its grace period). Off the async workers: the
    /// SDK's shutdown blocks until its batching task, on this runtime, has answered.
    pub async fn flush(self) {
        #[cfg(feature = "otel")]
        self.flush_traces().await;
    }

    #[cfg(feature = "otel")]
    async fn flush_traces(mut self) {
        let Some(p) = self.provider.take() else { return };
        let shutdown = tokio::task::spawn_blocking(move || p.shutdown());
        match tokio::time::timeout(std::time::Duration::from_secs(5), shutdown).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => tracing::warn!(error = %e, "flushing the last traces failed"),
            Ok(Err(e)) => tracing::warn!(error = %e, "flushing the last traces failed"),
            Err(_) => tracing::warn!("the trace collector did not take the last traces within 5 s"),
        }
    }
}

/// Whether the environment asks for traces.
fn endpoint_set() -> bool {
    [
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
    ]
    .iter()
    .any(|v| std::env::var(v).is_ok_and(|e| !e.trim().is_empty()))
}

/// Installs the log subscriber and, when an OTLP endpoint is set, the trace exporter. Must run
/// inside the tokio runtime (the exporter batches on it). `service` names the operator in the
/// traces unless `OTEL_SERVICE_NAME` does.
pub fn init(format: LogFormat, service: &str) -> Telemetry {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,kube_runtime=warn,kube_client=warn"));
    let fmt = tracing_subscriber::fmt::layer();
    let fmt = match format {
        LogFormat::Json => fmt.json().boxed(),
        LogFormat::Text => fmt.boxed(),
    }
    .with_filter(filter);
    #[cfg(feature = "otel")]
    {
        let (provider, error) = if endpoint_set() {
            match exporter(service) {
                Ok(p) => (Some(p), None),
                Err(e) => (None, Some(e)),
            }
        } else {
            (None, None)
        };
        let traces = provider.as_ref().map(|p| {
            tracing_opentelemetry::layer()
                .with_tracer(p.tracer("opkit"))
                .with_filter(
                    tracing_subscriber::filter::Targets::new().with_target("opkit", tracing::Level::DEBUG),
                )
                // Spans only: log events stay in the logs.
                .with_filter(tracing_subscriber::filter::filter_fn(|meta| meta.is_span()))
        });
        let _ = tracing_subscriber::registry().with(fmt).with(traces).try_init();
        if let Some(e) = error {
            tracing::error!(error = %e, "cannot export traces (OTEL_EXPORTER_OTLP_ENDPOINT); running without");
        } else if provider.is_some() {
            tracing::info!("exporting traces over OTLP/HTTP");
        }
        Telemetry { provider }
    }
    #[cfg(not(feature = "otel"))]
    {
        let _ = service;
        let _ = tracing_subscriber::registry().with(fmt).try_init();
        if endpoint_set() {
            tracing::warn!(
                "OTEL_EXPORTER_OTLP_ENDPOINT is set, but this operator was built without opkit's `otel` feature: no traces"
            );
        }
        Telemetry {}
    }
}

#[cfg(feature = "otel")]
fn exporter(service: &str) -> Result<SdkTracerProvider, String> {
    use opentelemetry_otlp::WithExportConfig as _;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
        .build()
        .map_err(|e| e.to_string())?;
    let batch = opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor::builder(
        exporter,
        opentelemetry_sdk::runtime::Tokio,
    )
    .build();
    let name = std::env::var("OTEL_SERVICE_NAME").unwrap_or_else(|_| service.to_string());
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(name)
        .build();
    Ok(SdkTracerProvider::builder()
        .with_span_processor(batch)
        .with_resource(resource)
        .build())
}
