"""Which writes a benchmark lane made, from the control plane's audit log.

A lane's writes per object above 4.00 say that something wrote more than the create and the
update need; this says what: each writer's writes by verb, resource and subresource, and how
many objects got one write, two, three... Keep the audit log with BENCH_STATE_DIR:

    BENCH_STATE_DIR=/tmp/state BENCH=memcached N=10000 BENCH_LANES=opkit ./target/release/opkit-bench
    python3 audit_writes.py /tmp/state/audit.log [USER_SUBSTRING]

USER_SUBSTRING (default "bench-") picks the writers: the lanes' service accounts.
"""
import collections
import sys

from audit_log import completed


def main(path, who="bench-"):
    by_kind = collections.Counter()
    per_object = collections.Counter()
    codes = collections.Counter()
    for e in completed(path, ("create", "update", "patch", "delete")):
        user = e.get("user", {}).get("username", "")
        if who not in user:
            continue
        r = e.get("objectRef", {})
        kind = (user, e["verb"], r.get("resource"), r.get("subresource"))
        by_kind[kind] += 1
        per_object[kind + (r.get("namespace"), r.get("name"))] += 1
        codes[(user, e.get("responseStatus", {}).get("code"))] += 1
    for kind, n in by_kind.most_common():
        print(n, *kind)
    print("response codes:", dict(codes))
    histogram = collections.Counter((k[:4], n) for k, n in per_object.items())
    for (kind, n), objects in sorted(histogram.items()):
        print(f"{objects} objects with {n} write(s):", *kind)


if __name__ == "__main__":
    main(*sys.argv[1:3])
