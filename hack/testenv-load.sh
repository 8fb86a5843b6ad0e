#!/usr/bin/env bash
# make testenv-load: saves $IMG from the container engine and loads it into the real node of
# the local control plane, under the name a Pod's `image: $IMG` resolves to (podman keeps an
# unqualified `opkit:v1` as localhost/opkit:v1; the kubelet asks for docker.io/library/opkit:v1).
set -euo pipefail
cd "$(dirname "$0")/.."
IMG=${IMG:?IMG is required}
tool=$(bash hack/container-tool.sh)
first=${IMG%%/*}
if [[ $IMG != */* ]]; then full=docker.io/library/$IMG
elif [[ $first != *.* && $first != *:* && $first != localhost ]]; then full=docker.io/$IMG
else full=$IMG; fi
mkdir -p target
"$tool" tag "$IMG" "$full"
"$tool" save -o target/opkit-image.tar "$full"
cargo run -q -p opkit-testenv -- load target/opkit-image.tar
