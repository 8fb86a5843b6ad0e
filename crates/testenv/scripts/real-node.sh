#!/usr/bin/env bash
# What the real node of the local control plane (OPKIT_TESTENV_REAL_NODE=1) needs besides the
# kubelet and kube-proxy that build-binaries.sh compiles: a container runtime, CNI plugins and
# iptables from Debian's packages, and the images the samples run, assembled from Debian
# packages because no image registry is reachable from here.
#
# Usage: real-node.sh install   install the Debian packages that are missing (root, apt-get)
#        real-node.sh images    build the image archives (if missing) and print their directory
#
# Images (docker-archive tarballs, loaded into the node's containerd by opkit-testenv):
#   registry.k8s.io/pause:3.10       Kubernetes' own pause.c, compiled static
#   docker.io/library/busybox:1.37   Debian's busybox-static (the At default image)
#   docker.io/library/memcached:1.6  Debian's memcached and the libraries it links
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=../versions.env
source "$here/../versions.env"
log() { echo "[real-node] $*" >&2; }

debs=(containerd runc containernetworking-plugins iptables podman busybox-static memcached gcc libc6-dev)
# A command each package provides, to tell whether it is installed.
probe=(containerd runc /usr/lib/cni/bridge iptables podman /bin/busybox memcached gcc /usr/lib/x86_64-linux-gnu/libc.a)

install() {
  local missing=()
  for i in "${!debs[@]}"; do
    local p=${probe[$i]}
    if [[ $p == /* ]]; then [[ -e $p ]] || missing+=("${debs[$i]}"); else command -v "$p" >/dev/null || missing+=("${debs[$i]}"); fi
  done
  ((${#missing[@]})) || return 0
  if [[ $(id -u) != 0 ]] || ! command -v apt-get >/dev/null; then
    log "error: the real node needs these Debian packages (as root: apt-get install ${missing[*]})"
    exit 1
  fi
  log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
}

# Builds one image with podman from a root filesystem directory: build_image <name> <rootfs> <Dockerfile lines...>
build_image() {
  local name=$1 rootfs=$2; shift 2
  printf '%s\n' "FROM scratch" "COPY . /" "$@" > "$rootfs.Dockerfile"
  podman build -q -f "$rootfs.Dockerfile" -t "$name" "$rootfs" >/dev/null
  podman save -q --format docker-archive -o "$rootfs.tar" "$name"
}

# Copies a dynamically linked program and every library ld.so resolves for it into <rootfs>.
copy_with_libs() {
  local prog=$1 rootfs=$2
  mkdir -p "$rootfs$(dirname "$prog")"
  cp "$prog" "$rootfs$prog"
  ldd "$prog" | grep -o '/[^ ]*' | while read -r lib; do
    mkdir -p "$rootfs$(dirname "$lib")"
    cp -L "$lib" "$rootfs$lib"
  done
}

images() {
  install
  local cache_root=${OPKIT_TESTENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/opkit-testenv}
  # Keyed by this script, so a change here rebuilds them.
  local out; out="$cache_root/images-$(sha256sum "${BASH_SOURCE[0]}" | cut -c1-12)"
  if [[ -f "$out/.done" ]]; then echo "$out"; return; fi
  log "assembling the sample images from Debian packages"
  rm -rf "$out"; mkdir -p "$out"
  local work; work=$(mktemp -d); trap 'rm -rf "$work"' RETURN

  mkdir -p "$work/pause"
  local pause_c; pause_c="$(GOFLAGS=-mod=mod go env GOMODCACHE)/k8s.io/kubernetes@${KUBERNETES_VERSION}/build/pause/linux/pause.c"
  [[ -f $pause_c ]] || (cd "$work" && GOFLAGS=-mod=mod go mod download "k8s.io/kubernetes@${KUBERNETES_VERSION}")
  gcc -Os -static -DVERSION="${KUBERNETES_VERSION}" -o "$work/pause/pause" "$pause_c"
  build_image registry.k8s.io/pause:3.10 "$work/pause" 'USER 65535:65535' 'ENTRYPOINT ["/pause"]'

  mkdir -p "$work/busybox/bin" "$work/busybox/tmp" "$work/busybox/etc"
  cp /bin/busybox "$work/busybox/bin/busybox"
  for applet in $(/bin/busybox --list); do
    [[ $applet == busybox ]] || ln -s busybox "$work/busybox/bin/$applet"
  done
  printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/home:/bin/false\n' > "$work/busybox/etc/passwd"
  chmod 1777 "$work/busybox/tmp"
  build_image docker.io/library/busybox:1.37 "$work/busybox" 'ENV PATH=/bin' 'CMD ["sh"]'

  mkdir -p "$work/memcached/tmp" "$work/memcached/etc"
  copy_with_libs /usr/bin/memcached "$work/memcached"
  printf 'memcache:x:11211:11211:memcache:/tmp:/bin/false\n' > "$work/memcached/etc/passwd"
  chmod 1777 "$work/memcached/tmp"
  build_image docker.io/library/memcached:1.6 "$work/memcached" 'ENV PATH=/usr/bin' 'USER 11211:11211' \
    'EXPOSE 11211' 'CMD ["memcached"]'

  for i in pause busybox memcached; do mv "$work/$i.tar" "$out/$i.tar"; done
  touch "$out/.done"
  log "images ready: $(du -sh "$out" | cut -f1) in $out"
  echo "$out"
}

case "${1:-}" in
  install) install ;;
  images) images ;;
  *) echo "usage: $0 install|images" >&2; exit 2 ;;
esac
