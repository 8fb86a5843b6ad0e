#!/usr/bin/env bash
# Assembles the operator's runtime base from this machine's Debian libraries, for where the
# distroless base cannot be pulled: the C libraries <binary> links (glibc, libgcc), the
# nonroot user 65532 and a /tmp, nothing else (no shell, no package manager) — what
# distroless cc-debian12:nonroot holds for it. Prints the image name.
# Usage: local-base.sh <container tool> <binary> [arch]   (or: opkit-testenv local-base)
#   arch  amd64 (this machine, the default) or arm64: the libraries of Debian's cross
#         toolchain (libc6-arm64-cross), the image marked linux/arm64.
set -euo pipefail
tool=$1 binary=$2 arch=${3:-amd64}
root=$(mktemp -d); trap 'rm -rf "$root" "$root.tar"' EXIT
case $arch in
  amd64)
    name=localhost/opkit-base:debian12
    bash "$(dirname "$0")/real-node.sh" copy-libs "$binary" "$root" ;;
  arm64)
    name=localhost/opkit-base:debian12-arm64
    libs=/usr/aarch64-linux-gnu/lib
    [[ -d $libs ]] || { echo "error: $libs missing: apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross" >&2; exit 1; }
    mkdir -p "$root/lib/aarch64-linux-gnu" "$root/lib"
    # The loader, and every library the binary names (each is in glibc or libgcc).
    cp -L "$libs/ld-linux-aarch64.so.1" "$root/lib/ld-linux-aarch64.so.1"
    for lib in $(aarch64-linux-gnu-readelf -d "$binary" | sed -n 's/.*Shared library: \[\(.*\)\]/\1/p'); do
      cp -L "$libs/$lib" "$root/lib/aarch64-linux-gnu/$lib"
    done ;;
  *) echo "error: no local base for $arch (amd64, arm64)" >&2; exit 1 ;;
esac
mkdir -p "$root/etc" "$root/tmp" "$root/home/nonroot"
chmod 1777 "$root/tmp"
printf 'root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' > "$root/etc/passwd"
printf 'root:x:0:\nnonroot:x:65532:\n' > "$root/etc/group"
chown 65532:65532 "$root/home/nonroot"
tar -C "$root" -cf "$root.tar" .
if [[ $(basename "$tool") == podman ]]; then
  "$tool" import -q --arch "$arch" --os linux "$root.tar" "$name" >/dev/null
else
  "$tool" import -q --platform "linux/$arch" "$root.tar" "$name" >/dev/null
fi
echo "$name"
