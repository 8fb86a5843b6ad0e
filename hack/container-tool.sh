#!/usr/bin/env bash
# Prints the container engine to use: $CONTAINER_TOOL if set, docker when its engine answers,
# else podman, installed from Debian's packages when missing (root, apt-get).
set -euo pipefail
if [[ -n ${CONTAINER_TOOL:-} ]]; then echo "$CONTAINER_TOOL"; exit 0; fi
if command -v docker >/dev/null && docker info >/dev/null 2>&1; then echo docker; exit 0; fi
if ! command -v podman >/dev/null; then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    echo ">> no container engine: installing podman from Debian's packages" >&2
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends podman >&2
  else
    echo "error: no container engine (docker with a running daemon, or podman); install one" >&2
    exit 1
  fi
fi
echo podman
