#!/usr/bin/env bash
# Compiles the local control plane (etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler, kubectl, kwok, kubelet and kube-proxy for the real node, the upstream
# sample-controller, Helm and an image registry) from pinned Go modules and caches the binaries outside the repo, keyed by version. Idempotent: prints the bin
# directory and exits at once when the cache is warm.
#
# Usage: build-binaries.sh              build what is missing, print the bin dir on stdout
#        build-binaries.sh --print      print the bin dir without building
#        build-binaries.sh --with-bench also build the benchmark's Go peers (make bench)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=../versions.env
source "$here/../versions.env"

cache_root=${OPKIT_TESTENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/opkit-testenv}
key="k8s-${KUBERNETES_VERSION}_etcd-${ETCD_VERSION}_kwok-${KWOK_VERSION}"
bin="$cache_root/$key/bin"

if [[ "${1:-}" == "--print" ]]; then
  echo "$bin"
  exit 0
fi

log() { echo "[build-binaries] $*" >&2; }

command -v go >/dev/null || { log "error: go is required to build the control plane"; exit 1; }

mkdir -p "$bin"
exec 9>"$cache_root/$key/.lock"
flock 9

start=$(date +%s)
work="$cache_root/$key/src"
mkdir -p "$work"
export CGO_ENABLED=0 GOFLAGS=-mod=mod GOTOOLCHAIN=local

# --- Kubernetes: k8s.io/kubernetes maps its staging modules with replace lines that only apply
# inside its own repo, so a wrapper module replaces each one with its published v0.x version.
k8s_minor=${KUBERNETES_VERSION#v1.}; k8s_minor=${k8s_minor%%.*}
staging_version="v0.${KUBERNETES_VERSION#v1.}"
# kubelet and kube-proxy run the real node (OPKIT_TESTENV_REAL_NODE=1).
k8s_tools=(kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kube-proxy)
need_k8s=0
for t in "${k8s_tools[@]}" sample-controller; do [[ -x "$bin/$t" ]] || need_k8s=1; done
if (( need_k8s )); then
  log "building Kubernetes ${KUBERNETES_VERSION} (cold builds take a long time on 2 cores)"
  d="$work/kubernetes"; rm -rf "$d"; mkdir -p "$d"; cd "$d"
  upstream_mod=$(go mod download -json "k8s.io/kubernetes@${KUBERNETES_VERSION}" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
  go_line=$(grep -m1 '^go ' "$upstream_mod")
  godebug_line=$(grep -m1 '^godebug ' "$upstream_mod" || true)
  {
    echo "module opkit.local/testenv/kubernetes"
    echo
    echo "$go_line"
    [[ -n "$godebug_line" ]] && echo "$godebug_line"
    echo
    echo "require k8s.io/kubernetes ${KUBERNETES_VERSION}"
    echo
    grep -E '^\s*k8s\.io/[a-z0-9-]+ => \./staging/' "$upstream_mod" \
      | awk -v v="$staging_version" '{print "replace " $1 " => " $1 " " v}'
  } > go.mod
  go get "k8s.io/kubernetes@${KUBERNETES_VERSION}" "k8s.io/sample-controller@${staging_version}" >&2
  ldflags="-s -w \
    -X k8s.io/component-base/version.gitVersion=${KUBERNETES_VERSION} \
    -X k8s.io/component-base/version.gitMajor=1 \
    -X k8s.io/component-base/version.gitMinor=${k8s_minor} \
    -X k8s.io/component-base/version.gitTreeState=clean \
    -X k8s.io/client-go/pkg/version.gitVersion=${KUBERNETES_VERSION}"
  for t in "${k8s_tools[@]}"; do
    [[ -x "$bin/$t" ]] && continue
    log "  go build $t"
    go build -trimpath -ldflags "$ldflags" -o "$bin/$t.tmp" "k8s.io/kubernetes/cmd/$t" && mv "$bin/$t.tmp" "$bin/$t"
  done
  if [[ ! -x "$bin/sample-controller" ]]; then
    log "  go build sample-controller"
    go build -trimpath -ldflags "-s -w" -o "$bin/sample-controller.tmp" k8s.io/sample-controller \
      && mv "$bin/sample-controller.tmp" "$bin/sample-controller"
  fi
fi

# --- etcd: its own go.mod has replace lines too, so a separate wrapper requires the server
# module (kept apart from Kubernetes so module selection does not move either side).
if [[ ! -x "$bin/etcd" ]]; then
  log "building etcd ${ETCD_VERSION}"
  d="$work/etcd"; rm -rf "$d"; mkdir -p "$d"; cd "$d"
  go mod init opkit.local/testenv/etcd >/dev/null 2>&1
  go get "go.etcd.io/etcd/server/v3@${ETCD_VERSION}" >&2
  go build -trimpath -ldflags "-s -w" -o "$bin/etcd.tmp" go.etcd.io/etcd/server/v3 && mv "$bin/etcd.tmp" "$bin/etcd"
fi

# --- kwok: its CEL library (easycel v0.6.0, the newest) caches types in plain maps that kwok's
# node and pod workers fill concurrently, so kwok can abort with "concurrent map writes" on
# start. A copy patched to lock them (patches/, rebuilt when the patch changes) replaces it.
kwok_patch="$here/patches/easycel-v0.6.0-concurrent-maps.patch"
kwok_stamp="${KWOK_VERSION} $(sha256sum "$kwok_patch" | cut -d' ' -f1)"
if [[ ! -x "$bin/kwok" || "$(cat "$bin/.kwok.stamp" 2>/dev/null)" != "$kwok_stamp" ]]; then
  log "building kwok ${KWOK_VERSION}"
  d="$work/kwok"; rm -rf "$d"; mkdir -p "$d"; cd "$d"
  go mod init opkit.local/testenv/kwok >/dev/null 2>&1
  go get "sigs.k8s.io/kwok@${KWOK_VERSION}" >&2
  easycel=$(go list -m -f '{{.Path}}@{{.Version}}' github.com/wzshiming/easycel)
  [[ "$easycel" == "github.com/wzshiming/easycel@v0.6.0" ]] \
    || { log "error: kwok now uses $easycel; check whether patches/$(basename "$kwok_patch") is still needed"; exit 1; }
  # `go get` fetched go.mod files only: the source to patch may not be in the module cache.
  go mod download github.com/wzshiming/easycel >&2
  cp -r "$(go list -m -f '{{.Dir}}' github.com/wzshiming/easycel)" easycel && chmod -R u+w easycel
  git apply --directory=easycel -p1 "$kwok_patch"
  go mod edit -replace github.com/wzshiming/easycel=./easycel
  go build -trimpath -ldflags "-s -w" -o "$bin/kwok.tmp" sigs.k8s.io/kwok/cmd/kwok && mv "$bin/kwok.tmp" "$bin/kwok"
  echo "$kwok_stamp" > "$bin/.kwok.stamp"
fi

# Builds a `main.go` kept in this repo as a Go module requiring `dep@version`, into
# $bin/<name>; rebuilt when the pinned version or the source changes (a stamp beside it).
# Usage: build_repo_main <name> <source> <dep> <version> [go build flags...]
build_repo_main() {
  local name=$1 src=$2 dep=$3 version=$4; shift 4
  local stamp; stamp="${version} $(sha256sum "$src" | cut -d' ' -f1)"
  if [[ -x "$bin/$name" && "$(cat "$bin/.$name.stamp" 2>/dev/null)" == "$stamp" ]]; then return; fi
  log "building $name ($dep $version)"
  local d="$work/$name"; rm -rf "$d"; mkdir -p "$d"; cd "$d"
  go mod init "opkit.local/testenv/$name" >/dev/null 2>&1
  cp "$src" main.go
  go get "$dep@$version" >&2
  go build -trimpath -ldflags "-s -w" "$@" -o "$bin/$name.tmp" . && mv "$bin/$name.tmp" "$bin/$name"
  echo "$stamp" > "$bin/.$name.stamp"
}

# --- bundle-validate (source in ../bundle-validate): the operator-framework's bundle
# validators, for `make bundle-validate`. The openpgp tag keeps the image library free of cgo
# (gpgme); nothing here verifies signatures.
build_repo_main bundle-validate "$here/../bundle-validate/main.go" \
  github.com/operator-framework/api "$OPERATOR_FRAMEWORK_API_VERSION" \
  -tags "containers_image_openpgp exclude_graphdriver_btrfs"

# --- kube-score: an outside opinion on the generated manifests (a test runs it).
if [[ ! -x "$bin/kube-score" || "$(cat "$bin/.kube-score.version" 2>/dev/null)" != "$KUBE_SCORE_VERSION" ]]; then
  log "building kube-score ${KUBE_SCORE_VERSION}"
  d="$work/kube-score"; rm -rf "$d"; mkdir -p "$d"; cd "$d"
  go mod init opkit.local/testenv/kube-score >/dev/null 2>&1
  go get "github.com/zegl/kube-score@${KUBE_SCORE_VERSION}" >&2
  go build -trimpath -ldflags "-s -w" -o "$bin/kube-score.tmp" github.com/zegl/kube-score/cmd/kube-score \
    && mv "$bin/kube-score.tmp" "$bin/kube-score"
  echo "$KUBE_SCORE_VERSION" > "$bin/.kube-score.version"
fi

# --- actionlint: a test checks the GitHub Actions workflows (opkit's and a scaffold's).
if [[ ! -x "$bin/actionlint" || "$(cat "$bin/.actionlint.version" 2>/dev/null)" != "$ACTIONLINT_VERSION" ]]; then
  log "building actionlint ${ACTIONLINT_VERSION}"
  d="$work/actionlint"; rm -rf "$d"; mkdir -p "$d"; cd "$d"
  go mod init opkit.local/testenv/actionlint >/dev/null 2>&1
  go get "github.com/rhysd/actionlint@${ACTIONLINT_VERSION}" >&2
  go build -trimpath -ldflags "-s -w" -o "$bin/actionlint.tmp" github.com/rhysd/actionlint/cmd/actionlint \
    && mv "$bin/actionlint.tmp" "$bin/actionlint"
  echo "$ACTIONLINT_VERSION" > "$bin/.actionlint.version"
fi

# --- registry (source in ../registry): go-containerregistry's registry, for `make docker-push`
# to the local control plane and its real node's pulls.
build_repo_main registry "$here/../registry/main.go" \
  github.com/google/go-containerregistry "$GO_CONTAINERREGISTRY_VERSION"

# --- helm: the chart's tests install, upgrade, roll back and uninstall it with the real Helm.
if [[ ! -x "$bin/helm" || "$(cat "$bin/.helm.version" 2>/dev/null)" != "$HELM_VERSION" ]]; then
  log "building helm ${HELM_VERSION}"
  d="$work/helm"; rm -rf "$d"; mkdir -p "$d"; cd "$d"
  go mod init opkit.local/testenv/helm >/dev/null 2>&1
  go get "helm.sh/helm/v3@${HELM_VERSION}" >&2
  go build -trimpath -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=${HELM_VERSION}" \
    -o "$bin/helm.tmp" helm.sh/helm/v3/cmd/helm && mv "$bin/helm.tmp" "$bin/helm"
  echo "$HELM_VERSION" > "$bin/.helm.version"
fi

# --- prometheus and promtool: a test scrapes the operator with the real Prometheus, runs every
# dashboard and alert expression through its HTTP API, and checks the rules with promtool.
# Built without the web UI's assets (the API is all the test uses).
if [[ ! -x "$bin/prometheus" || ! -x "$bin/promtool" || "$(cat "$bin/.prometheus.version" 2>/dev/null)" != "$PROMETHEUS_VERSION" ]]; then
  log "building prometheus ${PROMETHEUS_VERSION}"
  d="$work/prometheus"; rm -rf "$d"; mkdir -p "$d"; cd "$d"
  go mod init opkit.local/testenv/prometheus >/dev/null 2>&1
  go get "github.com/prometheus/prometheus@${PROMETHEUS_VERSION}" >&2
  mkdir -p out
  go build -trimpath -ldflags "-s -w" -o out/ \
    github.com/prometheus/prometheus/cmd/prometheus github.com/prometheus/prometheus/cmd/promtool \
    && mv out/prometheus "$bin/prometheus" && mv out/promtool "$bin/promtool"
  echo "$PROMETHEUS_VERSION" > "$bin/.prometheus.version"
fi

# --- memcached-peer (source in crates/bench/peer-memcached): the Memcached operator written on
# controller-runtime, raced by `make bench BENCH=memcached`. Only built for the benchmark.
if [[ "${1:-}" == "--with-bench" ]]; then
  build_repo_main memcached-peer "$here/../../bench/peer-memcached/main.go" \
    sigs.k8s.io/controller-runtime "$CONTROLLER_RUNTIME_VERSION"
fi

rm -rf "$work"
took=$(( $(date +%s) - start ))
if (( took > 2 )); then log "control-plane binaries ready in ${took}s: $bin"; fi
echo "$bin"
