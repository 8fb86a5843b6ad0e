"""Where the operator's live heap is, by allocation site, from a jemalloc heap profile.

The RSS an operator adds per cached object is mostly live heap; this says which part of the
runtime holds it. Build the operator with jemalloc's profiler and run a benchmark lane with
periodic heap dumps:

    CARGO_PROFILE_RELEASE_DEBUG=line-tables-only \\
      cargo build --release -p opkit-operator --features tikv-jemallocator/profiling
    _RJEM_MALLOC_CONF=prof:true,lg_prof_sample:16,lg_prof_interval:30,prof_prefix:/tmp/jp/opkit \\
      BENCH=memcached N=3000 BENCH_LANES=opkit ./target/release/opkit-bench
    python3 heap_sites.py target/release/opkit /tmp/jp/opkit.<pid>.<n>.i<n>.heap [DEPTH] [TOP]

Each stack's sampled bytes are scaled back to an estimate of all its live bytes (jemalloc
samples an allocation of s bytes with probability 1 - exp(-s / rate)), then grouped by its
first DEPTH frames outside the standard library, allocators and (de)serialisers. Needs
`addr2line` (binutils); jemalloc's own `jeprof` does not resolve a position-independent Rust
binary's addresses.
"""

import collections
import math
import re
import subprocess
import sys

GENERIC = re.compile(
    r"^(alloc::|core::|hashbrown::|serde|std::|bytes::|http::|smallvec|_rjem|tikv|__rust|prof_|je_"
    r"|imalloc|<(alloc|core|serde|hashbrown|std|bytes|http|Box|Vec|str|T as|&|\[|\()"
    r"|<k8s_openapi::.*(Deserialize|Visitor)|k8s_openapi::.*::deserialize|<kube_core::.*Deserialize)"
)


def main():
    binary, heap = sys.argv[1], sys.argv[2]
    depth = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    top = int(sys.argv[4]) if len(sys.argv) > 4 else 30
    lines = open(heap).read().split("\n")
    rate = int(lines[0].split("/")[1])
    name = binary.split("/")[-1]
    base = next(
        int(line.split("-")[0], 16)
        for line in lines
        if line.endswith("/" + name) and " r--p 00000000 " in line
    )
    stacks = []
    for i, line in enumerate(lines):
        if not line.startswith("@"):
            continue
        addrs = [int(a, 16) for a in line[1:].split()]
        m = re.match(r"\s*t\*:\s*(\d+):\s*(\d+)", lines[i + 1])
        count, sampled = int(m.group(1)), int(m.group(2))
        live = sampled / (1 - math.exp(-(sampled / count) / rate)) if count else 0
        stacks.append((addrs, live))
    unique = sorted({a for s, _ in stacks for a in s})
    # A return address points after its call: look the call itself up.
    out = subprocess.run(
        ["addr2line", "-f", "-C", "-e", binary] + [hex(a - base - 1) for a in unique],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    symbol = {a: out[2 * j] for j, a in enumerate(unique)}
    total = sum(b for _, b in stacks)
    sites = collections.Counter()
    for addrs, live in stacks:
        names = [symbol[a] for a in addrs]
        own = [n for n in names if n != "??" and not GENERIC.match(n)]
        sites[" <- ".join(n[:110] for n in (own or names)[:depth])] += live
    print(f"live heap {total / 1e6:.1f} MB")
    for site, live in sites.most_common(top):
        print(f"{live / 1e6:7.2f} MB {100 * live / total:5.1f}%  {site}")


if __name__ == "__main__":
    main()
