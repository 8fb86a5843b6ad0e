#!/usr/bin/env bash
# Checks (and where Debian can provide it, installs) what the build and the tests need.
set -euo pipefail
missing=()
need() { command -v "$1" >/dev/null 2>&1 || missing+=("$1"); }
need cargo; need go; need setpriv; need flock; need curl
if ((${#missing[@]})); then
  debs=()
  for m in "${missing[@]}"; do
    case "$m" in setpriv|flock) debs+=(util-linux) ;; curl) debs+=(curl) ;; esac
  done
  if ((${#debs[@]})) && command -v apt-get >/dev/null && [[ $(id -u) == 0 ]]; then
    apt-get update -qq && apt-get install -y -qq "${debs[@]}"
  fi
fi
for t in cargo go setpriv flock; do
  command -v "$t" >/dev/null 2>&1 || { echo "error: $t is required (Rust via rustup, Go >= 1.25)" >&2; exit 1; }
done
go_minor=$(go env GOVERSION | sed -E 's/^go1\.([0-9]+).*/\1/')
(( go_minor >= 25 )) || { echo "error: Go >= 1.25 is required to build Kubernetes 1.35, found $(go env GOVERSION)" >&2; exit 1; }
cargo fmt --version >/dev/null 2>&1 || rustup component add rustfmt
cargo clippy --version >/dev/null 2>&1 || rustup component add clippy
# The real node's container runtime, CNI plugins and iptables (Debian packages; root only, as
# the real-node tests are).
if [[ $(id -u) == 0 ]]; then bash "$(dirname "$0")/../crates/testenv/scripts/real-node.sh" install; fi
# The PostgreSQL server of the tests of operators of things outside the cluster (Debian's
# package; root installs it, others need it installed).
if [[ $(id -u) == 0 ]]; then bash "$(dirname "$0")/../crates/testenv/scripts/postgres.sh" install; fi
# `make docker-buildx` cross-compiles the linux/arm64 image's binary here: Rust's target and
# Debian's cross gcc (linker, ring's C) and arm64 glibc; qemu-user runs that binary in a test.
rustup target list --installed 2>/dev/null | grep -qx aarch64-unknown-linux-gnu \
  || rustup target add aarch64-unknown-linux-gnu \
  || echo "warning: could not add Rust's aarch64-unknown-linux-gnu target: make docker-buildx will retry" >&2
if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null \
  && ! { command -v aarch64-linux-gnu-gcc && command -v qemu-aarch64-static; } >/dev/null 2>&1; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user-static >/dev/null \
    || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user-static >/dev/null; }
fi
