#!/usr/bin/env bash
# make docker-buildx (opkit's and a scaffolded project's, through `opkit-testenv docker-buildx`):
# the operator image $IMG for every platform of $PLATFORMS (default linux/amd64,linux/arm64),
# pushed as one multi-architecture image (an image index). Run in the project's directory.
#
#   IMG        the image (required)
#   PACKAGE    the cargo package of the operator binary (required)
#   BINARY     the binary's name (default: PACKAGE)
#   PROFILE    cargo profile (default release; dev for a quick debug image)
#   BASE       the runtime base (default distroless cc, itself multi-arch); `local`, or one that
#              cannot be pulled: a base assembled from Debian's libraries of each architecture
#              (local-base.sh)
#
# Each binary is compiled on this machine, cross-compiled where the platform is not this
# machine's (Rust's aarch64-unknown-linux-gnu target and Debian's gcc-aarch64-linux-gnu,
# installed on first use), so nothing runs under emulation. It is staged as
# target/image/<arch>/manager, which the Dockerfile's `host-cross` stage copies (ARG TARGETARCH).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
IMG=${IMG:?IMG is required}
PACKAGE=${PACKAGE:?PACKAGE is required}
BINARY=${BINARY:-$PACKAGE}
PROFILE=${PROFILE:-release}
PLATFORMS=${PLATFORMS:-linux/amd64,linux/arm64}
BASE=${BASE:-gcr.io/distroless/cc-debian12:nonroot}
tool=${CONTAINER_TOOL:-$(if command -v docker >/dev/null && docker info >/dev/null 2>&1; then echo docker; else echo podman; fi)}
native=$(case $(uname -m) in x86_64) echo amd64 ;; aarch64) echo arm64 ;; *) uname -m ;; esac)
insecure=()
if [[ $(basename "$tool") == podman && $IMG =~ ^(127\.0\.0\.1|localhost)[:/] ]]; then insecure=(--tls-verify=false); fi
target_dir=$(cargo metadata --format-version 1 --no-deps | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
profile_dir=$([[ $PROFILE == dev ]] && echo debug || echo "$PROFILE")
# Debian's cross gcc links the arm64 binary and compiles ring's C and assembly.
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc AR_aarch64_unknown_linux_gnu=aarch64-linux-gnu-ar

if [[ $BASE != local ]] && ! timeout 120 "$tool" pull -q --platform linux/"$native" "$BASE" >/dev/null 2>&1; then
  echo ">> cannot pull $BASE: building on bases assembled from Debian's libraries (BASE=local)" >&2
  BASE=local
fi

# Rust's target for another architecture and Debian's cross gcc, installed on first use (the
# packages as root).
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
  echo ">> $platform: the $PROFILE binary ($triple)" >&2
  if [[ $arch == "$native" ]]; then
    cargo build --locked -q --profile "$PROFILE" -p "$PACKAGE"
    binary=$target_dir/$profile_dir/$BINARY
  else
    ensure_cross "$triple"
    cargo build --locked -q --profile "$PROFILE" -p "$PACKAGE" --target "$triple"
    binary=$target_dir/$triple/$profile_dir/$BINARY
  fi
  mkdir -p "target/image/$arch"
  cp "$binary" "target/image/$arch/manager"
  base=$BASE
  if [[ $BASE == local ]]; then base=$(bash "$here/local-base.sh" "$tool" "$binary" "$arch"); fi
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
