#!/usr/bin/env bash
# make docker-buildx: the operator image $IMG for every platform of $PLATFORMS (default
# linux/amd64,linux/arm64), pushed as one multi-architecture image (an OCI image index).
#
# Each binary is compiled on this machine, cross-compiled where the platform is not this
# machine's (Rust's aarch64-unknown-linux-gnu target and Debian's gcc-aarch64-linux-gnu:
# `hack/ensure-tools.sh` installs both), so no build stage runs under emulation. Each image is
# the Dockerfile's `host-cross` stage on BASE (default distroless cc, itself multi-arch) or, when
# that cannot be pulled or with BASE=local, on a base assembled from Debian's libraries of that
# architecture (crates/testenv/scripts/local-base.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
IMG=${IMG:?IMG is required}
PLATFORMS=${PLATFORMS:-linux/amd64,linux/arm64}
BASE=${BASE:-gcr.io/distroless/cc-debian12:nonroot}
tool=$(bash hack/container-tool.sh)
native=$(case $(uname -m) in x86_64) echo amd64 ;; aarch64) echo arm64 ;; *) uname -m ;; esac)
insecure=()
if [[ $(basename "$tool") == podman && $IMG =~ ^(127\.0\.0\.1|localhost)[:/] ]]; then insecure=(--tls-verify=false); fi

if [[ $BASE != local ]] && ! timeout 120 "$tool" pull -q --platform linux/"$native" "$BASE" >/dev/null 2>&1; then
  echo ">> cannot pull $BASE: building on bases assembled from Debian's libraries (BASE=local)" >&2
  BASE=local
fi

# Rust's target for another architecture and Debian's cross gcc (linker, ring's C), installed
# on first use (the packages as root).
ensure_cross() {
  local triple=$1 gcc=aarch64-linux-gnu-gcc
  rustup target list --installed | grep -qx "$triple" || rustup target add "$triple" >&2
  command -v "$gcc" >/dev/null && return
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    echo ">> installing Debian's arm64 cross toolchain" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends gcc-aarch64-linux-gnu libc6-dev-arm64-cross >&2 \
      || { apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        gcc-aarch64-linux-gnu libc6-dev-arm64-cross >&2; }
  else
    echo "error: $gcc is missing: apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross" >&2; exit 1
  fi
}

IFS=, read -ra platforms <<<"$PLATFORMS"
images=()
for platform in "${platforms[@]}"; do
  arch=${platform#linux/}
  case $arch in
    amd64) triple=x86_64-unknown-linux-gnu ;;
    arm64) triple=aarch64-unknown-linux-gnu ;;
    *) echo "error: platform $platform is not supported (linux/amd64, linux/arm64)" >&2; exit 1 ;;
  esac
  echo ">> $platform: the release binary ($triple)" >&2
  if [[ $arch == "$native" ]]; then
    cargo build --release --locked -q -p opkit-operator
    binary=target/release/opkit
  else
    ensure_cross "$triple"
    cargo build --release --locked -q -p opkit-operator --target "$triple"
    binary=target/$triple/release/opkit
  fi
  mkdir -p "target/image/$arch"
  cp "$binary" "target/image/$arch/opkit"
  base=$BASE
  if [[ $BASE == local ]]; then base=$(bash crates/testenv/scripts/local-base.sh "$tool" "$binary" "$arch"); fi
  "$tool" build -q --platform "$platform" --build-arg "BASE=$base" --target host-cross \
    -t "$IMG-$arch" . >/dev/null
  images+=("$IMG-$arch")
done

if [[ $(basename "$tool") == podman ]]; then
  podman manifest rm "$IMG" >/dev/null 2>&1 || true
  podman manifest create "$IMG" >/dev/null
  for image in "${images[@]}"; do podman manifest add "$IMG" "containers-storage:$image" >/dev/null; done
  podman manifest push "${insecure[@]}" --all "$IMG" "docker://$IMG"
else
  for image in "${images[@]}"; do docker push "$image" >/dev/null; done
  docker buildx imagetools create -t "$IMG" "${images[@]}"
fi
echo ">> pushed $IMG for $PLATFORMS" >&2
