//! The OpenTelemetry trace id in the reconcile span's log lines.

/// Records the OpenTelemetry trace id of `span` in its `trace_id` field (declared empty), so
/// that the log lines inside it carry the id a trace backend shows; nothing without traces.
#[cfg(feature = "otel")]
pub(crate) fn record_trace_id(span: &tracing::Span) {
    use opentelemetry::trace::TraceContextExt as _;
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;
    if span.is_disabled() {
        return;
    }
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    if sc.is_valid() {
        span.record("trace_id", tracing::field::display(sc.trace_id()));
    }
}

/// Without the `otel` feature no layer records traces, so there is no id to show.
#[cfg(not(feature = "otel"))]
pub(crate) fn record_trace_id(_span: &tracing::Span) {}
