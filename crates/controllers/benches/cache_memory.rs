//! Memory per cached object of the Memcached controller's caches, decoded and compact
//! ([`opkit::Watch::compact`]), with and without their index. Each case runs in a process of
//! its own and reports the growth of its resident set over 20000 objects made as the
//! apiserver would send them, and the time a read of each object takes ([`Cache::all`]).
//! Run with `cargo bench -p opkit-controllers --bench cache_memory`.
//!
//! The objects are built here, not read from a cluster: the benchmark (`make bench`) is where
//! the operator's memory is measured; this says which part of it a cache form moves.
mod fixtures;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kube::api::PartialObjectMeta;
use opkit::{Cache, Watch};
use opkit_api::memcached::{Memcached, MemcachedSpec};
use opkit_controllers::memcached::{DEFAULT_IMAGE, build_deployment, labels};

const N: usize = 20_000;

/// Resident bytes of this process.
fn rss() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
    let pages: usize = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .expect("resident pages");
    pages * 4096
}

fn time() -> Option<Time> {
    Some(Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH))
}

fn memcached(i: usize) -> Memcached {
    let mut mc = Memcached::new(&format!("memcached-{i:05}"), MemcachedSpec { size: 1 });
    let meta = &mut mc.metadata;
    meta.namespace = Some("bench".into());
    meta.uid = Some(format!("6f1d2c3e-8a4b-4c5d-9e6f-0a1b2c3d{i:04}"));
    meta.resource_version = Some(format!("{}", 1_000_000 + i));
    meta.generation = Some(1);
    meta.creation_timestamp = time();
    mc
}

/// A Deployment as `Watch::applied()` keeps it: what opkit applied, identity and status.
fn deployment(i: usize) -> Deployment {
    let mut d = build_deployment(&memcached(i), 1, DEFAULT_IMAGE).expect("a valid Memcached");
    let meta = &mut d.metadata;
    meta.uid = Some(format!("7f1d2c3e-8a4b-4c5d-9e6f-0a1b2c3d{i:04}"));
    meta.resource_version = Some(format!("{}", 2_000_000 + i));
    meta.generation = Some(1);
    meta.creation_timestamp = time();
    d.status = Some(fixtures::rolled_out());
    d
}

/// A Pod's metadata as the controller's trim leaves it.
fn pod(i: usize) -> PartialObjectMeta<Pod> {
    let mut labels = labels(&format!("memcached-{i:05}"));
    labels.insert("pod-template-hash".into(), "7d9f8b6c5d".into());
    PartialObjectMeta {
        metadata: ObjectMeta {
            name: Some(format!("memcached-{i:05}-7d9f8b6c5d-x2k4p")),
            namespace: Some("bench".into()),
            uid: Some(format!("8f1d2c3e-8a4b-4c5d-9e6f-0a1b2c3d{i:04}")),
            resource_version: Some(format!("{}", 3_000_000 + i)),
            creation_timestamp: time(),
            labels: Some(labels),
            ..Default::default()
        },
        ..Default::default()
    }
}

fn owner(d: &Deployment) -> Vec<String> {
    d.metadata
        .owner_references
        .iter()
        .flatten()
        .map(|o| o.uid.clone())
        .collect()
}

fn memcached_of(p: &PartialObjectMeta<Pod>) -> Option<String> {
    let name = p.metadata.labels.as_ref()?.get("memcached_cr")?;
    Some(format!("bench/{name}"))
}

fn uid(m: &Memcached) -> Option<String> {
    m.metadata.uid.clone()
}

fn fill<C>(what: &str, watch: Watch<C>, make: fn(usize) -> C)
where
    C: kube::Resource<DynamicType = ()> + Clone + serde::Serialize + serde::de::DeserializeOwned + 'static,
{
    let before = rss();
    // One object at a time, as a watch hands them over.
    let cache = Cache::from_objects(&watch, (0..N).map(make));
    let grown = rss().saturating_sub(before);
    // What a read costs: a decoded cache hands out its object, a compact one decodes a copy.
    let start = std::time::Instant::now();
    let read = std::hint::black_box(cache.all()).len();
    let each = start.elapsed().as_secs_f64() * 1e6 / read.max(1) as f64;
    println!("{what:<44} {:>8.0} {each:>8.2}", grown as f64 / N as f64);
    std::hint::black_box(cache);
}

const CASES: [&str; 7] = [
    "deployment",
    "deployment+index",
    "deployment compact",
    "deployment compact+index",
    "pod+index",
    "pod compact+index",
    "memcached+index",
];

fn main() {
    let case = std::env::args().nth(1).filter(|c| CASES.contains(&c.as_str()));
    let Some(case) = case else {
        println!(
            "{:<44} {:>8} {:>8}",
            "cache (20000 objects)", "B/object", "µs/read"
        );
        let exe = std::env::current_exe().expect("this benchmark's path");
        for case in CASES {
            let out = std::process::Command::new(&exe)
                .arg(case)
                .output()
                .expect("a case runs");
            print!("{}", String::from_utf8_lossy(&out.stdout));
        }
        return;
    };
    match case.as_str() {
        "deployment" => fill(&case, Watch::all(), deployment),
        "deployment+index" => fill(&case, Watch::all().index("owner", owner), deployment),
        "deployment compact" => fill(&case, Watch::all().compact(), deployment),
        "deployment compact+index" => fill(&case, Watch::all().compact().index("owner", owner), deployment),
        "pod+index" => fill(&case, Watch::all().index("memcached", memcached_of), pod),
        "pod compact+index" => fill(
            &case,
            Watch::all().compact().index("memcached", memcached_of),
            pod,
        ),
        _ => fill(&case, Watch::all().index("uid", uid), memcached),
    }
}
