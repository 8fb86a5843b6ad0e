"""A restart of the Memcached operator with 3 x N cached objects, without the race before it.

The benchmark's restart phase at N=10000 comes after a create and an update that take about
half an hour. This builds the same cache contents in about ten minutes and restarts opkit as
often as asked, printing for each restart the time until /readyz answers 200 and the CPU
seconds opkit and the apiserver spent until then:

- N Memcacheds of size 0 in namespace `bench` (their Deployments have no Pods, so the
  controller-manager does not create 10000 more) and N Pods labelled as the Memcached Pods
  are, bound to the kwok nodes, so that opkit caches N of each kind;
- opkit runs once until every Memcached shows a status (it applies the N Deployments); once
  the apiserver and the controller-manager are quiet again, the restarts.

    bash crates/testenv/scripts/build-binaries.sh   # the control plane, once
    cargo build --release -p opkit-operator
    python3 crates/bench/scripts/restart_at_scale.py [N] [RESTARTS]

N defaults to 10000 and RESTARTS to 3. The control plane keeps its state in
OPKIT_TESTENV_STATE (default /tmp/opkit-restart) and is stopped at the end, unless KEEP=1:
then a later run finds the N Memcacheds converged and goes straight to the restarts. To
compare two builds on the same cluster, OPKIT_BINS names them, comma-separated; the restarts
take turns (restart k runs build (k-1) mod count), so that a slow minute of the control plane
falls on both. Each run's log is left in the state directory as run-<k>.log ("cache synced"
lines say when each list ended). Nothing else may run on the machine meanwhile: the restart
shares its cores with the apiserver.
"""
import json
import os
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
STATE = os.environ.get("OPKIT_TESTENV_STATE", "/tmp/opkit-restart")
OPKIT = os.path.join(ROOT, "target", "release", "opkit")
BINS = [b for b in os.environ.get("OPKIT_BINS", OPKIT).split(",") if b]
HEALTH = "127.0.0.1:18081"


def sh(*args, **kw):
    return subprocess.run(args, check=True, text=True, capture_output=True, **kw).stdout


def testenv(*args):
    env = dict(os.environ, OPKIT_TESTENV_STATE=STATE)
    return subprocess.run(
        ["cargo", "run", "-q", "-p", "opkit-testenv", "--", *args],
        cwd=ROOT, env=env, check=True, text=True, capture_output=True,
    ).stdout


def cpu_ticks(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def pid_of(name):
    """The pid of the control-plane process whose command is `name`."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv0 = f.read().split(b"\0")[0].decode()
        except OSError:
            continue
        if os.path.basename(argv0) == name:
            return int(pid)
    return None


def ready():
    try:
        with urllib.request.urlopen(f"http://{HEALTH}/readyz", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def start(log, binary=OPKIT):
    return subprocess.Popen(
        [binary, "run", "--controllers", "memcached",
         "--metrics-bind-address", "127.0.0.1:18080", "--health-probe-bind-address", HEALTH,
         "--kubeconfig", os.path.join(STATE, "kubeconfig")],
        stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, RUST_LOG="info"),
    )


def stop(p):
    p.terminate()
    p.wait(timeout=60)


def control_plane(namespace):
    """Starts the long-lived control plane in STATE (or finds it running), points kubectl at
    it, installs the Memcached CRD and creates `namespace`."""
    for line in testenv("up").splitlines():
        if line.startswith("export PATH="):
            os.environ["PATH"] = line.split("=", 1)[1].split(":")[0] + ":" + os.environ["PATH"]
    os.environ["KUBECONFIG"] = os.path.join(STATE, "kubeconfig")
    sh("kubectl", "apply", "--server-side", "-f",
       os.path.join(ROOT, "config", "crd", "memcacheds.cache.example.com.yaml"))
    subprocess.run(["kubectl", "create", "namespace", namespace], capture_output=True)
    sh("kubectl", "wait", "--for=condition=Established", "crd/memcacheds.cache.example.com")


def main(n=10000, restarts=3):
    control_plane("bench")
    nodes = sh("kubectl", "get", "nodes", "-o", "name").split()
    nodes = [x.split("/", 1)[1] for x in nodes if "kwok" in x]
    if converged() < n:
        build(n, nodes)
    restart(restarts)
    if os.environ.get("KEEP") != "1":
        testenv("down")


def converged():
    """How many Memcacheds show a status (a kept cluster has them all)."""
    items = json.loads(sh("kubectl", "get", "memcacheds", "-n", "bench", "-o", "json"))["items"]
    return sum(1 for o in items if o.get("status", {}).get("conditions"))


def build(n, nodes):
    t = time.time()
    creates = []
    chunks = 4
    for c in range(chunks):
        mcs, pods = [], []
        for i in range(c * n // chunks, (c + 1) * n // chunks):
            name = f"mc-{i:05d}"
            mcs.append({"apiVersion": "cache.example.com/v1", "kind": "Memcached",
                        "metadata": {"name": name, "namespace": "bench"}, "spec": {"size": 0}})
            labels = {"app": "memcached", "memcached_cr": name,
                      "app.kubernetes.io/name": "memcached", "app.kubernetes.io/instance": name,
                      "app.kubernetes.io/managed-by": "opkit"}
            pods.append({"apiVersion": "v1", "kind": "Pod",
                         "metadata": {"name": f"{name}-pod", "namespace": "bench", "labels": labels},
                         "spec": {"nodeName": nodes[i % len(nodes)],
                                  "tolerations": [{"operator": "Exists"}],
                                  "containers": [{"name": "memcached", "image": "memcached:1.6"}]}})
        for kind, items in (("mc", mcs), ("pod", pods)):
            path = os.path.join(STATE, f"{kind}{c}.json")
            with open(path, "w") as f:
                json.dump({"apiVersion": "v1", "kind": "List", "items": items}, f)
            creates.append(subprocess.Popen(["kubectl", "create", "-f", path],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    for p in creates:
        if p.wait() != 0:
            sys.exit(f"kubectl create failed: {p.stderr.read().decode()}")
    print(f"created {n} Memcacheds and {n} Pods in {time.time() - t:.0f} s", flush=True)

    # Once: the Deployments and the statuses.
    t = time.time()
    with open(os.path.join(STATE, "converge.log"), "w") as log:
        p = start(log, BINS[0])
        while converged() < n:
            time.sleep(10)
        stop(p)
    print(f"converged in {time.time() - t:.0f} s", flush=True)


def restart(restarts):
    # The controller-manager works through the N new Deployments after opkit is done, and the
    # apiserver with it: the restarts wait until both are quiet.
    apiserver, manager = pid_of("kube-apiserver"), pid_of("kube-controller-manager")

    def quiet(limit, window=5):
        """Seconds until the apiserver and the controller-manager used under 0.1 core for
        `window` seconds (at most `limit`)."""
        t = time.time()
        while time.time() - t < limit:
            before = cpu_ticks(apiserver) + cpu_ticks(manager)
            time.sleep(window)
            if cpu_ticks(apiserver) + cpu_ticks(manager) - before < 10 * window:
                break
        return time.time() - t

    print(f"the control plane was quiet {quiet(600):.0f} s later", flush=True)

    for k in range(1, restarts + 1):
        binary = BINS[(k - 1) % len(BINS)]
        # The last restart's lists leave the apiserver collecting garbage for a while.
        quiet(60)
        with open(os.path.join(STATE, f"run-{k}.log"), "w") as log:
            a0, t0 = cpu_ticks(apiserver), time.time()
            p = start(log, binary)
            while not ready():
                time.sleep(0.01)
            took = time.time() - t0
            own, api = cpu_ticks(p.pid) / 100, (cpu_ticks(apiserver) - a0) / 100
            print(f"restart {k} ({binary}): ready {took:.2f} s; CPU until ready: opkit {own:.2f} s, "
                  f"apiserver {api:.2f} s", flush=True)
            time.sleep(20)
            stop(p)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
