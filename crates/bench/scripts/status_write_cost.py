"""What a status write of a Memcached costs the API server and etcd, by how it is sent.

opkit writes a status with a server-side apply to the status subresource (its
`resourceVersion` as a precondition); controller-runtime operators send the whole object with
an update (PUT), and a JSON merge patch is the third way. This measures the CPU the
kube-apiserver and etcd spend per write of each (and of an apply with
`fieldValidation=Ignore`), on the long-lived local control plane with
the controller-manager, scheduler and kwok stopped (SIGSTOP) so that nothing else runs:

- N Memcacheds per way, in namespace `status-cost`, each way writing only its own objects
  (a way's managed fields would change another's cost);
- rounds alternate the ways' order; in each round every object gets a status that differs
  from its last one (`readyReplicas` and a condition message carry the round), sent by 16 threads;
- the objects' `resourceVersion`s are listed before a round, outside the measured time.

    bash crates/testenv/scripts/build-binaries.sh   # the control plane, once
    python3 crates/bench/scripts/status_write_cost.py [N] [ROUNDS]

N defaults to 2000 and ROUNDS to 4 (of every way; an even number, for pairs). The control
plane keeps its state in OPKIT_TESTENV_STATE (default /tmp/opkit-status-cost) and is stopped
at the end unless KEEP=1.
Nothing else may run on the machine meanwhile.
"""
import concurrent.futures
import http.client
import json
import os
import ssl
import sys
import time
import threading
import urllib.parse

# The control plane's helpers, on a state directory of this script's own.
os.environ.setdefault("OPKIT_TESTENV_STATE", "/tmp/opkit-status-cost")
from restart_at_scale import control_plane, cpu_ticks, pid_of, sh, testenv  # noqa: E402

NS = "status-cost"
WAYS = ["apply", "apply-ignore", "update", "merge"]
MANAGER = "opkit-memcached"
THREADS = 16


class Api:
    """A minimal client from the kubeconfig's server, CA and bearer token."""

    def __init__(self, kubeconfig):
        cfg = json.loads(sh("kubectl", "config", "view", "--raw", "-o", "json", "--kubeconfig", kubeconfig))
        cluster = cfg["clusters"][0]["cluster"]
        self.server = cluster["server"]
        self.token = cfg["users"][0]["user"]["token"]
        self.ctx = ssl.create_default_context(cafile=cluster["certificate-authority"])
        self.local = threading.local()

    def call(self, method, path, body=None, ctype="application/json"):
        """One request on this thread's kept-alive connection (a TLS handshake per request
        would cost the API server more than the write)."""
        conn = getattr(self.local, "conn", None)
        if conn is None:
            host = urllib.parse.urlsplit(self.server).netloc
            conn = self.local.conn = http.client.HTTPSConnection(host, context=self.ctx, timeout=60)
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": ctype,
                                                       "Authorization": f"Bearer {self.token}"})
        r = conn.getresponse()
        out = r.read()
        if r.status >= 300:
            raise RuntimeError(f"{method} {path}: {r.status} {out[:300]!r}")
        return json.loads(out)


def path(name=None, status=False):
    p = f"/apis/cache.example.com/v1/namespaces/{NS}/memcacheds"
    if name:
        p += f"/{name}"
    if status:
        p += "/status"
    return p


def status_of(rnd):
    t = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    msg = f"{rnd}/0 replicas ready"
    return {
        "nodes": [],
        "readyReplicas": rnd,
        "observedGeneration": 1,
        "conditions": [
            {"type": "Available", "status": "False", "reason": "NotReady", "message": msg,
             "lastTransitionTime": t, "observedGeneration": 1},
            {"type": "Progressing", "status": "False", "reason": "Complete", "message": msg,
             "lastTransitionTime": t, "observedGeneration": 1},
            {"type": "Degraded", "status": "False", "reason": "AsExpected", "message": "spec is valid",
             "lastTransitionTime": t, "observedGeneration": 1},
        ],
    }


def write(api, way, obj, rnd):
    name = obj["metadata"]["name"]
    rv = obj["metadata"]["resourceVersion"]
    status = status_of(rnd)
    if way.startswith("apply"):
        body = {"apiVersion": "cache.example.com/v1", "kind": "Memcached",
                "metadata": {"name": name, "resourceVersion": rv}, "status": status}
        # `Ignore` spares the server the second, strict parse it makes (under its default,
        # `Warn`) to report unknown or duplicate fields.
        ignore = "&fieldValidation=Ignore" if way == "apply-ignore" else ""
        api.call("PATCH", path(name, True) + f"?fieldManager={MANAGER}&force=true{ignore}", body,
                 "application/apply-patch+yaml")
    elif way == "merge":
        body = {"metadata": {"resourceVersion": rv}, "status": status}
        api.call("PATCH", path(name, True) + f"?fieldManager={MANAGER}", body,
                 "application/merge-patch+json")
    else:
        body = dict(obj, status=status)
        api.call("PUT", path(name, True) + f"?fieldManager={MANAGER}", body)


def main(n=2000, rounds=4):
    control_plane(NS)
    api = Api(os.environ["KUBECONFIG"])
    have = {o["metadata"]["name"] for o in api.call("GET", path())["items"]}
    with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
        todo = [f"{w}-{i:05d}" for w in WAYS for i in range(n) if f"{w}-{i:05d}" not in have]
        list(pool.map(lambda name: api.call("POST", path(), {
            "apiVersion": "cache.example.com/v1", "kind": "Memcached",
            "metadata": {"name": name}, "spec": {"size": 0}}), todo))
    stopped = [p for p in (pid_of(x) for x in ("kube-controller-manager", "kube-scheduler", "kwok")) if p]
    for p in stopped:
        os.kill(p, 19)
    apiserver, etcd = pid_of("kube-apiserver"), pid_of("etcd")
    hz = os.sysconf("SC_CLK_TCK")
    results = {w: [] for w in WAYS}
    try:
        time.sleep(5)
        for rnd in range(1, rounds + 1):
            for w in WAYS if rnd % 2 else list(reversed(WAYS)):
                objs = [o for o in api.call("GET", path())["items"] if o["metadata"]["name"].rsplit("-", 1)[0] == w]
                time.sleep(2)
                a0, e0, t0 = cpu_ticks(apiserver), cpu_ticks(etcd), time.time()
                with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
                    list(pool.map(lambda o: write(api, w, o, rnd), objs))
                a1, e1, t1 = cpu_ticks(apiserver), cpu_ticks(etcd), time.time()
                per = lambda d: 1000.0 * d / hz / len(objs)
                results[w].append((per(a1 - a0), per(e1 - e0), t1 - t0))
                print(f"round {rnd} {w:12}: kube-apiserver {per(a1 - a0):.2f} ms, etcd {per(e1 - e0):.2f} ms "
                      f"per write, {len(objs)} writes in {t1 - t0:.1f} s", flush=True)
    finally:
        for p in stopped:
            os.kill(p, 18)
    print("\n| way | kube-apiserver CPU ms per status write | etcd CPU ms per status write |")
    print("|---|---|---|")
    for w in WAYS:
        a = sorted(r[0] for r in results[w])
        e = sorted(r[1] for r in results[w])
        print(f"| {w} | {a[0]:.2f}–{a[-1]:.2f} | {e[0]:.2f}–{e[-1]:.2f} |")
    # The control plane's cost drifts, between rounds and within one (a way measured later in
    # a round tends to cost more): ways compare within a round, and a pair of rounds, the
    # ways' order reversed in the second, evens the drift within them out.
    for w in ("apply", "apply-ignore", "merge"):
        ratios = [x[0] / u[0] for x, u in zip(results[w], results["update"])]
        pairs = [(a + b) / 2 for a, b in zip(ratios[0::2], ratios[1::2])]
        print(f"{w}/update, API server CPU per round: {', '.join(f'{r:.2f}' for r in ratios)}; "
              f"per pair of rounds: {', '.join(f'{r:.2f}' for r in pairs)}")
    if os.environ.get("KEEP") != "1":
        testenv("down")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
