#!/usr/bin/env bash
# Proves `opkit alpha update` on a real upgrade: a Guestbook project (API, controller,
# defaulting and validating webhooks) is scaffolded by the `opkit` of an older revision of
# this repository, committed, brought to this checkout's templates by `opkit alpha update`,
# then built and linted against this checkout's crates; `TEST=1` also runs its `make test`
# (a local control plane). Too long for `make test` (a second build of an older opkit and a
# project of its own): run it before a release that changes the templates or the author API.
#
#   bash hack/alpha-update-check.sh <older revision, e.g. v0.1.0 or a commit>
set -euo pipefail

from=${1:?usage: hack/alpha-update-check.sh <git revision of the older opkit>}
root=$(git rev-parse --show-toplevel)
work=${WORK:-$root/target/alpha-update-check}
rm -rf "$work/old"
git -C "$root" worktree prune
mkdir -p "$work"
git -C "$root" worktree add -q --detach "$work/old" "$from"
trap 'git -C "$root" worktree remove --force "$work/old"' EXIT

step() { printf '\n== %s (%s)\n' "$1" "$(date +%T)"; }
step "building opkit at $from"
(cd "$work/old" && CARGO_TARGET_DIR="$work/old-target" cargo build -q -p opkit-operator --bin opkit)
step "building opkit at $(git -C "$root" rev-parse --short HEAD)"
(cd "$root" && cargo build -q -p opkit-operator --bin opkit)
old=$work/old-target/debug/opkit
new=$(cd "$root" && cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/debug/opkit

step "scaffolding with the older opkit"
# Outside this checkout, as a user's project is (and so that its build stays out of it).
project=${PROJECT_DIR:-${TMPDIR:-/tmp}/opkit-alpha-update-check/guestbook}
rm -rf "$project"
mkdir -p "$project"
cd "$project"
gvk=(--group webapp --version v1 --kind Guestbook)
# The older templates, built against this checkout's crates once updated.
"$old" init --domain my.domain --project-name guestbook --opkit-path "$root"
"$old" create api "${gvk[@]}"
"$old" create webhook "${gvk[@]}" --defaulting --programmatic-validation
export GIT_AUTHOR_NAME=check GIT_AUTHOR_EMAIL=check@example.com GIT_COMMITTER_NAME=check GIT_COMMITTER_EMAIL=check@example.com
git init -q
git add .
git commit -qm "scaffolded by opkit at $from"

step "opkit alpha update"
# PROJECT's cliVersion, or (made before it was recorded) the older checkout's version.
version=$(sed -n 's/^cliVersion: //p' PROJECT)
version=${version:-$(sed -n 's/^version = "\(.*\)"/\1/p' "$work/old/Cargo.toml" | head -1)}
"$new" alpha update --from-binary "$old" --from-version "$version"
git status --short
git add -A
git commit -qm "opkit alpha update" || true

step "cargo build"
time cargo build -q --workspace --all-targets
step "cargo clippy"
cargo clippy -q --workspace --all-targets -- -D warnings
if [ "${TEST:-0}" = 1 ]; then
    step "make test"
    make test
fi
step "updated project builds: $project"
