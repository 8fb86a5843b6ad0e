#!/usr/bin/env bash
# Assembles the operator's runtime base from this machine's Debian libraries, for where the
# distroless base cannot be pulled: the C libraries <binary> links (glibc, libgcc), the
# nonroot user 65532 and a /tmp, nothing else (no shell, no package manager) — what
# distroless cc-debian12:nonroot holds for it. Prints the image name.
# Usage: local-base.sh <container tool> <binary>
set -euo pipefail
tool=$1 binary=$2
name=localhost/opkit-base:debian12
root=$(mktemp -d); trap 'rm -rf "$root"' EXIT
bash "$(dirname "$0")/../crates/testenv/scripts/real-node.sh" copy-libs "$binary" "$root"
mkdir -p "$root/etc" "$root/tmp" "$root/home/nonroot"
chmod 1777 "$root/tmp"
printf 'root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' > "$root/etc/passwd"
printf 'root:x:0:\nnonroot:x:65532:\n' > "$root/etc/group"
chown 65532:65532 "$root/home/nonroot"
tar -C "$root" -cf "$root.tar" .
"$tool" import -q "$root.tar" "$name" >/dev/null
rm -f "$root.tar"
echo "$name"
