#!/usr/bin/env bash
# make docker-build: the operator image $IMG with $CONTAINER_TOOL (docker when its engine
# answers, else podman, installed from Debian's packages when missing).
#
# BASE   runtime base image (default: the Dockerfile's distroless cc). When it cannot be pulled
#        (no registry reachable), or with BASE=local, an equivalent base is assembled from this
#        machine's Debian libraries (crates/testenv/scripts/local-base.sh) and the binary is built here
#        (`--target host`, with PROFILE), since the rust build image cannot be pulled either.
set -euo pipefail
cd "$(dirname "$0")/.."
IMG=${IMG:?IMG is required}
# The cargo profile of a binary built here (dev: a quick debug image, as the tests use).
PROFILE=${PROFILE:-release}
BASE=${BASE:-gcr.io/distroless/cc-debian12:nonroot}
tool=$(bash hack/container-tool.sh)

if [[ $BASE != local ]] && ! "$tool" image inspect "$BASE" >/dev/null 2>&1; then
  if ! timeout 120 "$tool" pull -q "$BASE" >/dev/null 2>&1; then
    echo ">> cannot pull $BASE: building on a base assembled from this machine's libraries (BASE=local)" >&2
    BASE=local
  fi
fi
target=()
if [[ $BASE == local ]]; then
  echo ">> building the $PROFILE binary on this machine" >&2
  cargo build --locked -q --profile "$PROFILE" -p opkit-operator
  dir=$([[ $PROFILE == dev ]] && echo debug || echo "$PROFILE")
  mkdir -p target/image
  cp "target/$dir/opkit" target/image/manager
  BASE=$(bash crates/testenv/scripts/local-base.sh "$tool" target/image/manager)
  target=(--target host)
fi
"$tool" build --build-arg "BASE=$BASE" "${target[@]}" -t "$IMG" .
size=$("$tool" image inspect "$IMG" --format '{{.Size}}')
echo ">> built $IMG with $tool on $BASE: $(( size / 1024 / 1024 )) MiB ($size bytes)" >&2
