#!/usr/bin/env bash
# make deploy / make build-installer: every object of config/default, with $IMG as the
# manager's image (kustomize's images transformer, as `kustomize edit set image` does), on
# stdout. IMG is name:tag; a name with no tag runs :latest.
set -euo pipefail
cd "$(dirname "$0")/.."
IMG=${IMG:?IMG is required}
KUBECTL=${KUBECTL:?KUBECTL is required}
name=$IMG tag=latest
if [[ ${IMG##*/} == *:* ]]; then name=${IMG%:*} tag=${IMG##*:}; fi
mkdir -p target
dir=$(mktemp -d target/kustomize.XXXXXX)
trap 'rm -rf "$dir"' EXIT
cat >"$dir/kustomization.yaml" <<YAML
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
- ../../config/default
images:
- name: opkit
  newName: $name
  newTag: "$tag"
YAML
"$KUBECTL" kustomize "$dir"
