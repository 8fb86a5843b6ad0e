#!/usr/bin/env bash
# The dev loop in one command: use the cluster of $KUBECONFIG, or start the local control plane;
# install the CRDs, apply the samples and run the operator in the foreground.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -z "${KUBECONFIG:-}" || ! -f "${KUBECONFIG}" ]]; then
  echo ">> no KUBECONFIG configured: starting the local control plane (make testenv-up)"
  eval "$(cargo run -q -p opkit-testenv -- up)"
fi
bin_dir=$(bash crates/testenv/scripts/build-binaries.sh --print)
kubectl=${KUBECTL:-$bin_dir/kubectl}
[[ -x "$kubectl" ]] || kubectl=kubectl

echo ">> building opkit"
cargo build -q -p opkit-operator
opkit=target/debug/opkit

echo ">> installing CRDs"
"$opkit" crd | "$kubectl" apply --server-side -f -
"$kubectl" wait --for condition=Established --timeout=60s crd --all >/dev/null

if "$kubectl" get node opkit-real-node >/dev/null 2>&1; then
  # The local control plane has a real node (OPKIT_TESTENV_REAL_NODE=1): the samples' Pods run
  # there, in real containers, instead of on the kwok fakes.
  echo ">> real node: the Pods of namespace default run in containers on opkit-real-node"
  "$kubectl" annotate --overwrite namespace default \
    'scheduler.alpha.kubernetes.io/node-selector=opkit.dev/node=real' \
    'scheduler.alpha.kubernetes.io/defaultTolerations=[{"key":"opkit.dev/real-node","operator":"Exists","effect":"NoSchedule"}]' >/dev/null
fi

# Webhook configurations left by an earlier run point at a server that is not up yet, and At's
# and ConfigMirror's fail closed: they go, and the operator writes them again as it starts.
"$kubectl" delete --ignore-not-found mutatingwebhookconfiguration/opkit-mutating-webhook-configuration \
  validatingwebhookconfiguration/opkit-validating-webhook-configuration >/dev/null

# PostgresDatabase's sample names the server of Secret postgres-server: a throwaway one when
# PostgreSQL is installed (crates/testenv/scripts/postgres.sh install), stopped with the operator.
pg=""
if compgen -G "/usr/lib/postgresql/*/bin/postgres" >/dev/null; then
  echo ">> starting a throwaway PostgreSQL server for the PostgresDatabase sample"
  pg_secret=$(mktemp)
  cargo run -q -p opkit-testenv -- postgres --secret postgres-server >"$pg_secret" &
  pg=$!
  until [[ -s "$pg_secret" ]] && grep -q password "$pg_secret"; do
    kill -0 "$pg" 2>/dev/null || { echo "PostgreSQL did not start" >&2; exit 1; }
    sleep 0.5
  done
  "$kubectl" apply -f "$pg_secret" >/dev/null
  rm -f "$pg_secret"
fi

echo ">> applying samples"
# The v1 CronTab is stored as v2 through the operator's conversion webhook: applied below, once
# the operator serves it.
for f in config/samples/*.yaml; do
  [[ "$f" == */stable_v1_crontab.yaml ]] && continue
  "$kubectl" apply -f "$f"
done

cat <<EOT

>> opkit is starting. In another terminal:
     export KUBECONFIG=$KUBECONFIG
     alias kubectl=$kubectl
     kubectl get memcached                       # SIZE / READY / AVAILABLE
     kubectl patch memcached memcached-sample --type merge -p '{"spec":{"size":5}}'
     kubectl scale deployment memcached-sample --replicas=7   # reverted by opkit
     kubectl describe memcached memcached-sample # conditions and events
     kubectl get at,eru,foo                      # the cnat, Eru and sample-controller samples
     kubectl get pgdb app                        # a database on the throwaway PostgreSQL server
     kubectl get secret app-postgres -o jsonpath='{.data.uri}' | base64 -d
     kubectl label namespace kube-public mirror.opkit.dev/app-settings=true
     kubectl get configmirror                    # app-settings copied to kube-public
     kubectl label namespace default team=web
     kubectl annotate namespace default labels.opkit.dev/propagate=team
     kubectl get deploy,configmap -L team        # every one labelled team=web
     kubectl logs example-at-pod                 # YAY (from a container with the real node)
     kubectl get crontabs.v1.stable.example.com  # the CronTabs as v1 (stored as v2, converted by opkit)
     kubectl get crontabs.v2.stable.example.com -o yaml
     kubectl apply -f - <<< '{"apiVersion":"cache.example.com/v1","kind":"Memcached","metadata":{"name":"nosize"},"spec":{}}'
                                                 # defaulted to size 1 by its schema
     curl -s localhost:8080/metrics              # controller-runtime's families and opkit_*:
                                                 # docs/observability.md lists them, the alerts
                                                 # and the Grafana dashboards in config/
   Ctrl-C stops the operator; 'make testenv-down' stops the local control plane.

EOT
# The apiserver reaches the webhooks at 127.0.0.1:9443; while the operator is stopped, At and
# ConfigMirror objects are refused (failurePolicy Fail), Memcacheds and Erus are not (Ignore).
"$opkit" run --metrics-bind-address 127.0.0.1:8080 --health-probe-bind-address 127.0.0.1:8081 \
  --webhook-bind-address 127.0.0.1:9443 --webhook-url https://127.0.0.1:9443 \
  --label-propagation-resources deployments.v1.apps,configmaps.v1 &
op=$!
trap 'kill -TERM "$op" ${pg:+"$pg"} 2>/dev/null; wait "$op"' INT TERM
# Only once the operator has pointed the CRD at its conversion webhook: before that the
# apiserver would store the v1 object relabelled as v2, without converting it.
until [[ "$("$kubectl" get crd crontabs.stable.example.com -o jsonpath='{.spec.conversion.strategy}')" == Webhook ]] &&
  "$kubectl" apply -f config/samples/stable_v1_crontab.yaml >/dev/null 2>&1; do
  kill -0 "$op" 2>/dev/null || break
  sleep 1
done
wait "$op" || status=$?
[[ -n "$pg" ]] && kill -TERM "$pg" 2>/dev/null
exit "${status:-0}"
