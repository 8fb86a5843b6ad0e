#!/usr/bin/env bash
# What the real node of the local control plane (OPKIT_TESTENV_REAL_NODE=1) needs besides the
# kubelet and kube-proxy that build-binaries.sh compiles: a container runtime, CNI plugins and
# iptables from Debian's packages, and the images the samples run, assembled from Debian
# packages because no image registry is reachable from here.
#
# Usage: real-node.sh install   install the Debian packages that are missing (root, apt-get)
#        real-node.sh images    build the image archives (if missing) and print their directory
#        real-node.sh clean [--remove] [DIR] [KUBE_PROXY]
#                               stop what a stopped (or killed) real node leaves: its containers,
#                               containerd's shims, mounts under DIR (all testenv ones without
#                               DIR), its cgroups and, given KUBE_PROXY, kube-proxy's iptables
#                               rules; --remove deletes DIR too
#        real-node.sh copy-libs PROGRAM ROOTFS
#                               copy the libraries PROGRAM links into ROOTFS (what
#                               scripts/local-base.sh assembles the operator's base with)
#        real-node.sh reap PID [--remove] DIR KUBE_PROXY
#                               wait until process PID is gone, then clean
#
# Images (docker-archive tarballs, loaded into the node's containerd by opkit-testenv):
#   registry.k8s.io/pause:3.10       Kubernetes' own pause.c, compiled static
#   docker.io/library/busybox:1.37   Debian's busybox-static (the At default image)
#   docker.io/library/memcached:1.6  Debian's memcached and the libraries it links
#   docker.io/library/nginx:1.27     Debian's nginx-light answering 200 on port 80 (the Eru and
#                                    Foo samples' web servers; also tagged latest, which the
#                                    kubelet always pulls, so a Pod asking for it cannot start)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=../versions.env
source "$here/../versions.env"
log() { echo "[real-node] $*" >&2; }

debs=(containerd runc containernetworking-plugins iptables podman busybox-static memcached nginx-light gcc libc6-dev)
# A command each package provides, to tell whether it is installed.
probe=(containerd runc /usr/lib/cni/bridge iptables podman /bin/busybox memcached /usr/sbin/nginx gcc /usr/lib/x86_64-linux-gnu/libc.a)

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

# Copies every library ld.so resolves for a dynamically linked program into <rootfs>.
copy_libs() {
  local prog=$1 rootfs=$2
  ldd "$prog" | grep -o '/[^ ]*' | while read -r lib; do
    mkdir -p "$rootfs$(dirname "$lib")"
    cp -L "$lib" "$rootfs$lib"
  done
}

# Copies a program (an absolute path) and its libraries into <rootfs>.
copy_with_libs() {
  local prog=$1 rootfs=$2
  mkdir -p "$rootfs$(dirname "$prog")"
  cp "$prog" "$rootfs$prog"
  copy_libs "$prog" "$rootfs"
}

images() {
  install
  local cache_root=${OPKIT_TESTENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/opkit-testenv}
  # Keyed by this script, so a change here rebuilds them.
  local out; out="$cache_root/images-$(sha256sum "${BASH_SOURCE[0]}" | cut -c1-12)"
  if [[ -f "$out/.done" ]]; then echo "$out"; return; fi
  log "assembling the sample images from Debian packages"
  rm -rf "$cache_root"/images-*; mkdir -p "$out"
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

  mkdir -p "$work/nginx/etc/nginx" "$work/nginx/var/log/nginx" "$work/nginx/var/lib/nginx" "$work/nginx/tmp"
  copy_with_libs /usr/sbin/nginx "$work/nginx"
  chmod 1777 "$work/nginx/tmp"
  printf 'root:x:0:0:root:/root:/bin/false\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n' > "$work/nginx/etc/passwd"
  printf 'root:x:0:\nnogroup:x:65534:\n' > "$work/nginx/etc/group"
  cat > "$work/nginx/etc/nginx/nginx.conf" <<'CONF'
daemon off;
user nobody nogroup;
error_log /dev/stderr;
pid /tmp/nginx.pid;
events {}
http {
  access_log /dev/stdout;
  client_body_temp_path /tmp/client_body;
  proxy_temp_path /tmp/proxy;
  fastcgi_temp_path /tmp/fastcgi;
  uwsgi_temp_path /tmp/uwsgi;
  scgi_temp_path /tmp/scgi;
  server {
    listen 80;
    location / { default_type text/plain; return 200 "nginx\n"; }
  }
}
CONF
  build_image docker.io/library/nginx:1.27 "$work/nginx" 'EXPOSE 80' 'STOPSIGNAL SIGQUIT' 'CMD ["/usr/sbin/nginx"]'
  podman tag docker.io/library/nginx:1.27 docker.io/library/nginx:latest
  rm -f "$work/nginx.tar"
  podman save -q -m --format docker-archive -o "$work/nginx.tar" docker.io/library/nginx:1.27 docker.io/library/nginx:latest

  for i in pause busybox memcached nginx; do mv "$work/$i.tar" "$out/$i.tar"; done
  touch "$out/.done"
  log "images ready: $(du -sh "$out" | cut -f1) in $out"
  echo "$out"
}

# The kubelet's cgroup root (see node.rs): every Pod of the real node lives under it.
cgroup_root=opkit-testenv

clean() {
  local remove=0
  if [[ ${1:-} == --remove ]]; then remove=1; shift; fi
  local dir=${1:-} kube_proxy=${2:-}
  local tmp_root; tmp_root="$(dirname "$(mktemp -u)")/opkit-testenv"
  # The containers first: killing their shims alone leaves them running.
  local h pids
  for h in /sys/fs/cgroup/pids/$cgroup_root /sys/fs/cgroup/$cgroup_root; do
    [[ -d $h ]] || continue
    for _ in $(seq 20); do
      pids=$(find "$h" -name cgroup.procs -exec cat {} + 2>/dev/null | tr '\n' ' ')
      [[ -z ${pids// } ]] && break
      # shellcheck disable=SC2086
      kill -9 $pids 2>/dev/null || true
      sleep 0.05
    done
  done
  # Shims of this node's containerd (of every testenv one without DIR): theirs is gone.
  pkill -9 -f "containerd-shim.* -address ${dir:-$tmp_root}" 2>/dev/null || true
  # Mounts (container root filesystems, network namespaces, volumes), deepest first.
  if [[ -n $dir ]]; then
    awk '{print $5}' /proc/self/mountinfo | grep -F "$dir/" | sort -r | while read -r m; do
      umount -l "$m" 2>/dev/null || true
    done
  fi
  for h in /sys/fs/cgroup/*/$cgroup_root /sys/fs/cgroup/$cgroup_root; do
    [[ -d $h ]] && find "$h" -mindepth 1 -depth -type d -exec rmdir {} + 2>/dev/null || true
  done
  if [[ -n $kube_proxy && -x $kube_proxy ]]; then "$kube_proxy" --cleanup >/dev/null 2>&1 || true; fi
  if (( remove )) && [[ -n $dir ]]; then rm -rf "$dir"; fi
}

case "${1:-}" in
  install) install ;;
  images) images ;;
  clean) shift; clean "$@" ;;
  copy-libs) copy_libs "$2" "$3" ;;
  reap)
    pid=$2; shift 2
    while kill -0 "$pid" 2>/dev/null; do sleep 0.5; done
    # Under the machine-wide real-node lock (node.rs): never while another node runs.
    exec 9>/run/opkit-testenv-real-node.lock
    flock 9
    clean "$@" ;;
  *) echo "usage: $0 install|images|clean|copy-libs|reap" >&2; exit 2 ;;
esac
