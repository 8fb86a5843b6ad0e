"""How long the API server took over each lane's writes, from the control plane's audit log.

Two lanes that make the same writes can still differ in how long the API server takes to answer
them (a POST against a server-side apply that creates). This gives, per lane: the mean time
from a write's arrival to its answer by verb, resource and subresource, and every 20 s of the
lane the writes per second and how many were in flight on average (the sum of their times over
the 20 s). Keep the audit log with BENCH_STATE_DIR:

    BENCH_STATE_DIR=/tmp/state BENCH=memcached N=10000 BENCH_CREATE_ONLY=1 ./target/release/opkit-bench
    python3 audit_latency.py /tmp/state/audit.log [BUCKETS]

BUCKETS (default 20) is how many 20 s steps of each lane to print.
"""
import collections
import sys
from datetime import datetime

from audit_log import completed

STEP = 20


def seconds(stamp):
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def main(path, buckets=20):
    writes = collections.defaultdict(list)
    for event in completed(path, ("create", "update", "patch")):
        parts = event.get("user", {}).get("username", "").split(":")
        if len(parts) < 4 or not parts[2].startswith("bench-"):
            continue
        ref = event.get("objectRef", {})
        writes[parts[2]].append(
            (
                seconds(event["requestReceivedTimestamp"]),
                seconds(event["stageTimestamp"]),
                (event["verb"], ref.get("resource"), ref.get("subresource", "")),
            )
        )
    for lane, rows in writes.items():
        rows.sort()
        start = rows[0][0]
        print(f"== {lane}: {len(rows)} writes")
        by_kind = collections.defaultdict(lambda: [0, 0.0])
        by_step = collections.defaultdict(lambda: [0, 0.0])
        for arrived, answered, kind in rows:
            for acc, key in ((by_kind, kind), (by_step, int((arrived - start) // STEP))):
                acc[key][0] += 1
                acc[key][1] += answered - arrived
        for kind, (n, total) in sorted(by_kind.items()):
            print(f"  {' '.join(k for k in kind if k)}: {n}, mean {1000 * total / n:.1f} ms")
        for step in sorted(by_step)[:buckets]:
            n, total = by_step[step]
            print(
                f"  from {step * STEP:4d} s: {n / STEP:6.1f} writes/s, mean {1000 * total / n:6.1f} ms,"
                f" {total / STEP:5.1f} in flight"
            )


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:3]))
