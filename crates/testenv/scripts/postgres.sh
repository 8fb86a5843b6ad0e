#!/usr/bin/env bash
# The PostgreSQL server the tests of operators of things outside the cluster run against
# (opkit_testenv::postgres): Debian's package, without the cluster and service it would set up
# (each test makes a throwaway cluster of its own on a free port).
#
# Usage: postgres.sh install   install the Debian package if missing (root, apt-get)
set -euo pipefail
log() { echo "[postgres] $*" >&2; }

install() {
  compgen -G '/usr/lib/postgresql/*/bin/postgres' >/dev/null && return 0
  if [[ $(id -u) != 0 ]] || ! command -v apt-get >/dev/null; then
    log "error: the tests need PostgreSQL's server (as root: apt-get install postgresql-15)"
    exit 1
  fi
  # No default cluster, and no service started by the package's scripts.
  mkdir -p /etc/postgresql-common
  grep -qs '^create_main_cluster' /etc/postgresql-common/createcluster.conf \
    || echo 'create_main_cluster = false' >> /etc/postgresql-common/createcluster.conf
  log "installing postgresql-15"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq --no-install-recommends postgresql-15 >&2 \
    || { apt-get update -qq >&2 && apt-get install -y -qq --no-install-recommends postgresql-15 >&2; }
}

case "${1:-}" in
  install) install ;;
  *) echo "usage: $0 install" >&2; exit 2 ;;
esac
