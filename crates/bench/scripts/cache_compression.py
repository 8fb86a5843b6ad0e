"""What a compact cache's objects would take compressed with a dictionary.

A compact cache (`Watch::compact`) keeps each object as its JSON. Objects of one kind that one
controller made are nearly alike, so each can be compressed against a sibling: this measures
how far, on objects read from a cluster. It projects Deployments onto the fields their manager
applied (as `Watch::applied()` does) and drops what the Memcached controller's trims drop.

    kubectl get deploy -n NS -o json --show-managed-fields > deps.json
    kubectl get pods -n NS -o json --show-managed-fields > pods.json
    kubectl get memcached -n NS -o json --show-managed-fields > mcs.json
    pip install lz4
    python3 cache_compression.py MANAGER deps.json pods.json mcs.json

MANAGER is the field manager of the controller's applies (`opkit-memcached`).
"""

import json
import statistics
import sys
import timeit

import lz4.block
import zlib

IDENTITY = ["name", "namespace", "uid", "resourceVersion", "generation",
            "creationTimestamp", "deletionTimestamp", "ownerReferences"]


def project(value, fields):
    """The part of `value` a fieldsV1 set names (f: fields, k: keyed and v: set items)."""
    children = {k: v for k, v in fields.items() if k != "."}
    if not children:
        return value
    if isinstance(value, dict):
        return {k[2:]: project(value[k[2:]], f) for k, f in children.items()
                if k.startswith("f:") and k[2:] in value}
    if isinstance(value, list):
        out = []
        for k, f in children.items():
            if k.startswith("k:"):
                key = json.loads(k[2:])
                out += [project(i, f) for i in value if all(i.get(a) == b for a, b in key.items())]
            elif k.startswith("v:"):
                out.append(json.loads(k[2:]))
        return out
    return value


def merge(into, other):
    for k, v in other.items():
        if isinstance(into.get(k), dict) and isinstance(v, dict):
            merge(into[k], v)
        else:
            into[k] = v


def applied(obj, manager):
    out = {}
    for e in obj["metadata"].get("managedFields", []):
        if e["manager"] == manager and e["operation"] == "Apply" and not e.get("subresource"):
            merge(out, project(obj, e["fieldsV1"]))
    for k in ["apiVersion", "kind", "status"]:
        if k in obj:
            out[k] = obj[k]
    meta = out.setdefault("metadata", {})
    for k in IDENTITY:
        if k in obj["metadata"]:
            meta[k] = obj["metadata"][k]
    out.get("status", {}).pop("conditions", None)  # trim_deployment
    return out


def pod_meta(obj):
    meta = dict(obj["metadata"])
    for k in ["managedFields", "annotations", "ownerReferences", "generateName"]:  # trim_pod
        meta.pop(k, None)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta}


def report(what, objects):
    encoded = [json.dumps(o, separators=(",", ":")).encode() for o in objects]
    dictionary, rest = encoded[0], encoded[1:]

    def median(f):
        return statistics.median(f(e) for e in rest)

    lz4_dict = [lz4.block.compress(e, store_size=False, dict=dictionary) for e in rest]
    decode_us = 1e6 * timeit.timeit(
        lambda: [lz4.block.decompress(c, uncompressed_size=4096, dict=dictionary) for c in lz4_dict],
        number=10) / (10 * len(rest))
    print(f"| {what} | {len(rest)} | {median(len):.0f} | {median(lambda e: len(zlib.compress(e, 6))):.0f} "
          f"| {median(lambda e: len(lz4.block.compress(e, store_size=False))):.0f} "
          f"| {statistics.median(len(c) for c in lz4_dict):.0f} ({max(len(c) for c in lz4_dict)}) "
          f"| {decode_us:.2f} |")


def main():
    manager, deps, pods, mcs = sys.argv[1:5]
    items = lambda path: json.load(open(path))["items"]
    print("| objects | n | JSON B | zlib B | LZ4 B | LZ4, a sibling as dictionary: B (max) | decode µs |")
    print("|---|---|---|---|---|---|---|")
    report("Deployment, applied fields", [applied(o, manager) for o in items(deps)])
    report("Pod, metadata trimmed", [pod_meta(o) for o in items(pods)])
    report("Memcached, as listed", items(mcs))
    report("Memcached, without managedFields", [
        {**o, "metadata": {k: v for k, v in o["metadata"].items() if k != "managedFields"}}
        for o in items(mcs)])


if __name__ == "__main__":
    main()
