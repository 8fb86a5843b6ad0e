#!/usr/bin/env bash
# make testenv-load: saves $IMG from the container engine and loads it into the real node of
# the local control plane, under the name a Pod's `image: $IMG` resolves to (podman keeps an
# unqualified `opkit:v1` as localhost/opkit:v1; the kubelet asks for docker.io/library/opkit:v1).
# With ARCHIVE=<file> it only writes the archive there (a test loads it into its own node).
set -euo pipefail
cd "$(dirname "$0")/.."
IMG=${IMG:?IMG is required}
tool=$(bash hack/container-tool.sh)
first=${IMG%%/*}
if [[ $IMG != */* ]]; then full=docker.io/library/$IMG
elif [[ $first != *.* && $first != *:* && $first != localhost ]]; then full=docker.io/$IMG
else full=$IMG; fi
archive=${ARCHIVE:-target/opkit-image.tar}
mkdir -p "$(dirname "$archive")"
rm -f "$archive"
"$tool" tag "$IMG" "$full"
"$tool" save -q -o "$archive" "$full"
[[ -n ${ARCHIVE:-} ]] || cargo run -q -p opkit-testenv -- load "$archive"
