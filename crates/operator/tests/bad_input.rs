//! Careless and hostile input: what opkit could not use is refused at admission (CRD schema,
//! CEL, webhook) with a message naming the field; what is stored is reconciled without storms.
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, anyhow, ensure};
use kube::Api;
use kube::api::{DynamicObject, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use opkit_testenv::{http_get, shared, wait_for};
use serde_json::{Value, json};

mod common;
use common::{Running, free_port, install_crds, kubectl_stdin};

const T: Duration = Duration::from_secs(60);
/// Generated specs per kind.
const SPECS: usize = 1000;

fn apply(ns: &str, yaml: &str) -> anyhow::Result<(bool, String)> {
    kubectl_stdin(&["apply", "-n", ns, "-f", "-"], yaml.as_bytes())
}

#[tokio::test]
async fn names_too_long_for_labels_or_pod_names_are_refused_by_the_crd() {
    shared()
        .in_namespace("names", |_, ns| async move {
            install_crds()?;
            let memcached = "apiVersion: cache.example.com/v1alpha1\nkind: Memcached\nmetadata:\n  name: NAME\nspec:\n  size: 0\n";
            let foo = "apiVersion: samplecontroller.k8s.io/v1alpha1\nkind: Foo\nmetadata:\n  name: NAME\nspec:\n  deploymentName: d\n  replicas: 1\n";
            let at = "apiVersion: cnat.programming-kubernetes.info/v1alpha1\nkind: At\nmetadata:\n  name: NAME\nspec:\n  schedule: \"2030-01-01T00:00:00Z\"\n  command: \"true\"\n";
            let cases = [
                (memcached, 63, "metadata.name must be at most 63 characters: it labels the memcached Pods"),
                (foo, 63, "metadata.name must be at most 63 characters: it labels the Deployment's Pods"),
                (at, 249, "metadata.name must be at most 249 characters: its Pod is named <name>-pod"),
            ];
            for (yaml, max, message) in cases {
                let (ok, out) = apply(&ns, &yaml.replace("NAME", &"a".repeat(max + 1)))?;
                ensure!(!ok && out.contains(message), "a name of {} characters: {out}", max + 1);
                let (ok, out) = apply(&ns, &yaml.replace("NAME", &"a".repeat(max)))?;
                ensure!(ok, "a name of {max} characters was refused: {out}");
            }
            Ok(())
        })
        .await;
}

/// A deterministic generator (xorshift), so a failing case reproduces.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn pick<T: Clone>(&mut self, xs: &[T]) -> T {
        xs[(self.next() % xs.len() as u64) as usize].clone()
    }
    fn name(&mut self, i: usize) -> String {
        // Mostly fine names, some too long for a label or any object, some not DNS names.
        match self.next() % 10 {
            0 => format!("n{i}-{}", "x".repeat(60)),
            1 => format!("n{i}-{}", "y".repeat(250)),
            2 => format!("Bad_Name{i}"),
            _ => format!("n{i}"),
        }
    }
}

/// One spec per call: each field valid most of the time, else extreme or invalid, so that
/// both refusals and stored objects are plenty.
fn spec(kind: &str, r: &mut Rng) -> Value {
    let field = |r: &mut Rng, good: &[Value], bad: &[Value]| {
        if r.next().is_multiple_of(5) {
            r.pick(bad)
        } else {
            r.pick(good)
        }
    };
    match kind {
        "Memcached" => json!({
            // 100 is legal but costs 100 Pods a time; one in a hundred objects gets it.
            "size": if r.next().is_multiple_of(100) { json!(100) } else {
                field(r, &[json!(0), json!(1), json!(2), json!(3)],
                    &[json!(-5), json!(-1), json!(101), json!(2147483647), json!("3"), json!(1.5), Value::Null])
            },
            "unknownField": field(r, &[Value::Null], &[json!("pruned")]),
        }),
        "At" => json!({
            "schedule": field(r, &[json!("2099-01-01T00:00:00Z"), json!("2030-06-01T12:00:00+08:00"),
                json!("2019-04-12T10:12:00Z"), json!("9999-12-31T23:59:59Z")],
                &[json!("2000-01-01T00:00:00Z"), json!("0001-01-01T00:00:00Z"), json!("tomorrow"),
                json!("2019-04-12"), json!("2019-04-12T10:12:00"), json!("2019-13-45T99:99:99Z"), json!(""),
                json!(42), json!("x".repeat(100))]),
            "command": field(r, &[json!("true"), json!("echo YAY"), json!("exit 3"), json!("ünïcødé ✓")],
                &[json!(""), json!("x".repeat(5000)), Value::Null]),
            "image": field(r, &[Value::Null, json!("busybox:1.37")], &[json!(""), json!("x".repeat(600))]),
            "activeDeadlineSeconds": field(r, &[Value::Null, json!(1), json!(604800)], &[json!(0), json!(-1), json!(604801)]),
            "ttlSecondsAfterFinished": field(r, &[Value::Null, json!(0), json!(60)], &[json!(-1), json!("soon")]),
        }),
        "Eru" => json!({
            "deploymentName": field(r, &[json!("missing"), json!("web.v2")],
                &[json!("Web_1"), json!(""), json!("a".repeat(300))]),
            "schedule": field(r, &[json!("* * * * * *"), json!("0 3 * * *"), json!("5/4294967295 * * * *"),
                json!("@daily"), json!("* * 0-11 * * *")],
                &[json!("*/0 * * * *"), json!("61 * * * *"), json!("0 0 30 2 *"), json!("@fortnightly"),
                json!(""), json!("1-2-3 * * * *"), json!("* * * * * * *"), json!("x".repeat(200))]),
            "timeZone": field(r, &[Value::Null, json!("UTC"), json!("Asia/Shanghai")],
                &[json!("Mars/Olympus"), json!("../etc/passwd"), json!("")]),
            "startingDeadlineSeconds": field(r, &[Value::Null, json!(1), json!(9_999_999_999i64)], &[json!(0), json!(-5)]),
            "suspend": field(r, &[Value::Null, json!(true), json!(false)], &[json!("yes")]),
        }),
        _ => json!({
            "deploymentName": field(r, &[json!("d"), json!("web")], &[json!("Web_1"), json!(""), json!("a".repeat(300))]),
            "replicas": field(r, &[Value::Null, json!(1), json!(2)], &[json!(-1), json!(0), json!(11), json!("2")]),
        }),
    }
}

/// Sums a counter over every label set in the Prometheus text.
fn counter(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with('{'))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn peak_rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            l.strip_prefix("VmHWM:")?
                .trim()
                .trim_end_matches(" kB")
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or(0)
}

/// At least 1000 generated specs per kind through the real apiserver, with the operator and
/// its webhooks running: each is refused with a message naming a field, or stored and then
/// reconciled; the operator never exits, its reconciles stop once the work is done (no hot
/// loop, even for 1000 per-second Erus whose Deployment does not exist) and its memory stays
/// under the manager's 128Mi limit.
#[tokio::test]
async fn a_thousand_generated_specs_per_kind_are_refused_readably_or_reconciled_quietly() {
    shared()
        .in_namespace("generated", |client, ns| async move {
            install_crds()?;
            let port = free_port()?;
            let metrics_port = free_port()?;
            let log = std::env::temp_dir().join(format!("opkit-generated-{ns}.log"));
            let mut op = Running(
                Command::new(env!("CARGO_BIN_EXE_opkit"))
                    .args(["run", "--namespace", &ns])
                    .args(["--metrics-bind-address", &format!("127.0.0.1:{metrics_port}")])
                    .args(["--health-probe-bind-address", "0"])
                    .args(["--webhook-bind-address", &format!("127.0.0.1:{port}")])
                    .args(["--webhook-url", &format!("https://127.0.0.1:{port}")])
                    .env("KUBECONFIG", shared().kubeconfig())
                    .stdout(Stdio::null())
                    .stderr(std::fs::File::create(&log)?)
                    .spawn()?,
            );
            let pid = op.0.id();
            let metrics = || async move {
                let (code, body) = http_get(([127, 0, 0, 1], metrics_port).into(), "/metrics").await?;
                ensure!(code == 200, "/metrics answered {code}");
                anyhow::Ok(body)
            };
            // The webhooks are in place once a size-less Memcached is defaulted.
            let mc = ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("cache.example.com", "v1", "Memcached"), "memcacheds");
            let memcacheds: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &mc);
            wait_for("the webhooks to answer", T, || async {
                let probe: DynamicObject = serde_json::from_value(json!({
                    "apiVersion": "cache.example.com/v1", "kind": "Memcached",
                    "metadata": {"generateName": "probe-"}, "spec": {}}))?;
                memcacheds.create(&PostParams::default(), &probe).await?;
                anyhow::Ok(())
            })
            .await?;

            let kinds = [
                ("Memcached", "cache.example.com", "v1", "memcacheds"),
                ("At", "cnat.programming-kubernetes.info", "v1alpha1", "ats"),
                ("Eru", "mtsre.meitu.com", "v1", "erus"),
                ("Foo", "samplecontroller.k8s.io", "v1alpha1", "foos"),
            ];
            let mut rng = Rng(0x2545_f491_4f6c_dd1d);
            let started = std::time::Instant::now();
            let mut report = Vec::new();
            for (kind, group, version, plural) in kinds {
                let ar = ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind), plural);
                let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &ar);
                let mut tasks = tokio::task::JoinSet::new();
                let (mut accepted, mut refused) = (0, 0);
                for i in 0..SPECS {
                    let body = json!({
                        "apiVersion": format!("{group}/{version}"), "kind": kind,
                        "metadata": {"name": rng.name(i)}, "spec": spec(kind, &mut rng),
                    });
                    let api = api.clone();
                    tasks.spawn(async move {
                        let obj: DynamicObject = serde_json::from_value(body.clone())?;
                        match api.create(&PostParams::default(), &obj).await {
                            Ok(_) => anyhow::Ok(true),
                            Err(kube::Error::Api(s)) if (400..500).contains(&s.code) => {
                                let m = &s.message;
                                ensure!(
                                    m.contains("spec.") || m.contains("metadata.name") || m.contains("spec:"),
                                    "refused without naming a field ({}): {m}\n{body}", s.code
                                );
                                Ok(false)
                            }
                            Err(e) => Err(anyhow!("{e}: {body}")),
                        }
                    });
                    if tasks.len() >= 16 {
                        if tasks.join_next().await.context("a task")??? { accepted += 1 } else { refused += 1 }
                    }
                }
                while let Some(r) = tasks.join_next().await {
                    if r?? { accepted += 1 } else { refused += 1 }
                }
                report.push(format!("{kind}: {accepted} stored, {refused} refused"));
                ensure!(accepted > 0 && refused > 0, "{kind}: {accepted} stored, {refused} refused");
            }
            println!("{} in {:.0?}", report.join("; "), started.elapsed());

            // The work ends: reconciles per second fall to (almost) nothing and stay there.
            // Polled every 2 s with a deadline; quiet = five samples in a row under 1/s.
            let deadline = std::time::Instant::now() + Duration::from_secs(240);
            let mut last = (counter(&metrics().await?, "opkit_reconcile_total"), std::time::Instant::now());
            let (mut quiet, mut rate) = (0, f64::MAX);
            while quiet < 5 {
                if std::time::Instant::now() >= deadline {
                    let m = metrics().await?;
                    let lines: Vec<&str> = m
                        .lines()
                        .filter(|l| l.starts_with("opkit_reconcile_total{") || l.starts_with("opkit_reconcile_errors_total{") || l.starts_with("opkit_api_writes_total{"))
                        .collect();
                    let log = std::fs::read_to_string(&log).unwrap_or_default();
                    let tail: Vec<&str> = log.lines().rev().take(40).collect();
                    anyhow::bail!("still {rate:.1} reconciles/s after 240 s\n{}\n--- log tail ---\n{}", lines.join("\n"), tail.join("\n"));
                }
                tokio::time::sleep(Duration::from_secs(2)).await;
                let now = (counter(&metrics().await?, "opkit_reconcile_total"), std::time::Instant::now());
                rate = (now.0 - last.0) / now.1.duration_since(last.1).as_secs_f64();
                last = now;
                quiet = if rate < 1.0 { quiet + 1 } else { 0 };
            }
            let total = counter(&metrics().await?, "opkit_reconcile_total");
            let errors = counter(&metrics().await?, "opkit_reconcile_errors_total");
            let rss = peak_rss_kib(pid);
            println!(
                "quiet after {:.0?}: {rate:.2} reconciles/s over the last 10 s; {total} reconciles, {errors} errors; peak RSS {} MiB",
                started.elapsed(),
                rss / 1024
            );
            ensure!(op.0.try_wait()?.is_none(), "the operator exited:\n{}", std::fs::read_to_string(&log)?);
            ensure!(rss > 0 && rss < 128 * 1024, "peak RSS {rss} KiB");
            Ok(())
        })
        .await;
}
