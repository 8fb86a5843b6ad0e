//! CPU of a no-op reconcile of a converged Memcached: the plan, the comparison of its
//! Deployment with the cached one, and the comparison of its status with the live one, as
//! the runtime makes them; and what `observe` pays to decode its objects from the compact
//! caches. Run with `cargo bench -p opkit-controllers --bench noop`.
//!
//! The status comparison is timed twice: reading the live status by serialising the whole
//! object (how opkit did it before `opkit::diff::status_of`), and with `status_of`.
mod fixtures;

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::jiff::Timestamp;
use kube::api::PartialObjectMeta;
use opkit::Reconciler;
use opkit::diff::{same, status_of};
use opkit_api::memcached::{Memcached, MemcachedSpec, MemcachedStatus};
use opkit_controllers::memcached::{DEFAULT_IMAGE, MemcachedController, World, build_deployment, pod_labels};
use serde_json::Value;

/// A Memcached as the primary cache holds it after it converged, and what its plan observes.
fn converged(controller: &MemcachedController, now: Timestamp) -> (Memcached, World) {
    let mut mc = Memcached::new("memcached-sample-00042", MemcachedSpec { size: 1 });
    let meta = &mut mc.metadata;
    meta.namespace = Some("bench".into());
    meta.uid = Some("6f1d2c3e-8a4b-4c5d-9e6f-0a1b2c3d4e5f".into());
    meta.resource_version = Some("1234567".into());
    meta.generation = Some(1);
    meta.creation_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(now));
    meta.finalizers = Some(vec!["cache.example.com/finalizer".into()]);
    let mut deployment = build_deployment(&mc, 1, DEFAULT_IMAGE).expect("a valid Memcached");
    deployment.metadata.generation = Some(1);
    deployment.status = Some(fixtures::rolled_out());
    let pod = PartialObjectMeta::<Pod> {
        metadata: ObjectMeta {
            name: Some(format!(
                "{}-7d9f8b6c5d-x2k4p",
                mc.metadata.name.as_deref().unwrap_or_default()
            )),
            namespace: Some("bench".into()),
            labels: Some(pod_labels("memcached-sample-00042")),
            ..Default::default()
        },
        ..Default::default()
    };
    let world = World {
        deployment: Some(Arc::new(deployment)),
        pods: vec![Arc::new(pod)],
    };
    let plan = controller.plan(&mc, &world, now).expect("a plan");
    mc.status = plan.status;
    (mc, world)
}

/// The runtime's status decision: is the planned status already the live one?
fn status_unchanged(planned: &MemcachedStatus, live_status: Value) -> bool {
    let live: MemcachedStatus = serde_json::from_value(live_status).unwrap_or_default();
    let desired = serde_json::to_value(planned).expect("a status serialises");
    same(
        &desired,
        &serde_json::to_value(live).expect("a status serialises"),
    )
}

/// Nanoseconds per call of `f`: the best of five rounds of `iterations` calls.
fn time(iterations: u32, mut f: impl FnMut()) -> f64 {
    (0..5)
        .map(|_| {
            let start = Instant::now();
            for _ in 0..iterations {
                f();
            }
            start.elapsed()
        })
        .min()
        .unwrap_or(Duration::ZERO)
        .as_nanos() as f64
        / f64::from(iterations)
}

fn main() {
    let controller = MemcachedController::default();
    let now = Timestamp::from_second(1_790_000_000).expect("a time");
    let (mc, world) = converged(&controller, now);
    let noop = |read: &dyn Fn(&Memcached) -> Value| {
        let plan = controller.plan(&mc, &world, now).expect("a plan");
        assert!(
            !plan.children.iter().any(|c| c.is_needed()),
            "the Deployment is converged"
        );
        let status = plan.status.expect("a status");
        assert!(status_unchanged(&status, read(&mc)), "the status is converged");
        black_box(plan.children);
    };
    let whole = |mc: &Memcached| serde_json::to_value(mc).expect("json")["status"].take();
    let alone = |mc: &Memcached| status_of(mc);
    let desired = build_deployment(&mc, 1, DEFAULT_IMAGE).expect("a valid Memcached");
    let cached = world.deployment.as_deref().expect("a Deployment");
    let desired_json = serde_json::to_value(&desired).expect("json");
    let cached_json = serde_json::to_value(cached).expect("json");
    // What `observe` reads from the controller's compact caches.
    let deployments = opkit::Cache::from_objects(&opkit::Watch::all().compact(), [cached.clone()]);
    let pods = opkit::Cache::from_objects(
        &opkit::Watch::all().compact(),
        world.pods.iter().map(|p| (**p).clone()),
    );
    let (ns, name) = ("bench", "memcached-sample-00042");
    let pod_name = world.pods[0].metadata.name.clone().unwrap_or_default();
    const N: u32 = 20_000;
    let rows = [
        (
            "observe: decode the Deployment (compact cache)",
            time(N, || {
                black_box(deployments.get(black_box(ns), name));
            }),
        ),
        (
            "observe: decode a Pod (compact cache)",
            time(N, || {
                black_box(pods.get(black_box(ns), &pod_name));
            }),
        ),
        (
            "plan (Deployment compared inside)",
            time(N, || {
                black_box(controller.plan(black_box(&mc), &world, now).ok());
            }),
        ),
        (
            "  of which: build the Deployment",
            time(N, || {
                black_box(build_deployment(black_box(&mc), 1, DEFAULT_IMAGE).ok());
            }),
        ),
        (
            "  of which: serialise the desired Deployment",
            time(N, || {
                black_box(serde_json::to_value(black_box(&desired)).ok());
            }),
        ),
        (
            "  of which: serialise the cached Deployment",
            time(N, || {
                black_box(serde_json::to_value(black_box(cached)).ok());
            }),
        ),
        (
            "  of which: compare the two",
            time(N, || {
                black_box(opkit::diff::is_subset(
                    black_box(&desired_json),
                    black_box(&cached_json),
                ));
            }),
        ),
        (
            "read the live status: whole object",
            time(N, || {
                black_box(whole(black_box(&mc)));
            }),
        ),
        (
            "read the live status: status_of",
            time(N, || {
                black_box(alone(black_box(&mc)));
            }),
        ),
        (
            "no-op reconcile, status via whole object",
            time(N, || noop(&whole)),
        ),
        ("no-op reconcile, status via status_of", time(N, || noop(&alone))),
    ];
    println!("{:<48} {:>10}", "step (converged Memcached, size 1)", "µs/call");
    for (what, ns) in rows {
        println!("{what:<48} {:>10.2}", ns / 1000.0);
    }
}
