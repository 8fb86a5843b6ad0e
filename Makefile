# opkit — targets named as Kubebuilder users type them. `make help` lists them.
SHELL := /usr/bin/env bash
comma := ,
.DEFAULT_GOAL := help

TESTENV_BIN_DIR = $(shell bash crates/testenv/scripts/build-binaries.sh --print)
KUBECTL ?= $(TESTENV_BIN_DIR)/kubectl
OPKIT := cargo run -q -p opkit-operator --
VERSION ?= 0.1.0
IMG ?= opkit:v$(VERSION)
# docker when its engine answers, else podman (installed from Debian's packages when missing).
CONTAINER_TOOL ?= $(shell bash hack/container-tool.sh)
# Runtime base of the operator image; `local` assembles one from this machine's libraries.
BASE ?=
TESTENV := cargo run -q -p opkit-testenv --
# A registry on this machine (the local control plane's, 127.0.0.1:5000) speaks plain HTTP:
# podman must be told; docker trusts 127.0.0.0/8 by itself.
insecure = $(if $(and $(findstring podman,$(CONTAINER_TOOL)),$(filter 127.0.0.1:% localhost:%,$(1))),--tls-verify=false)

.PHONY: help
help: ## Show this help
	@awk 'BEGIN {FS = ":.*##"} /^[a-zA-Z_-]+:.*?##/ {printf "  \033[36m%-14s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)

.PHONY: build
build: ## Build the opkit binary (release)
	cargo build --release -p opkit-operator

.PHONY: fmt
fmt: ## Format the code
	cargo fmt --all

# lint also packages the crates a project depends on or scaffolds with, as crates.io would take
# them (scripts, templates and versions.env inside). opkit-scaffold is built from its package
# here; the four a scaffolded project depends on are built from theirs by the scaffold test of
# `make test`, so lint does not compile their dependency tree a second time.
.PHONY: lint
lint: ## Check formatting, clippy with warnings denied, that the runtime imports only downward, that opkit builds without its default features, the docs, and that the published crates package and build
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -- -D warnings
	cargo test -q -p opkit-runtime --test layers
	cargo check -q -p opkit --no-default-features
	RUSTDOCFLAGS="-D warnings" cargo doc --no-deps -q -p opkit -p opkit-runtime -p opkit-gen -p opkit-testenv -p opkit-scaffold
	cargo package --locked --allow-dirty --no-verify -q -p opkit -p opkit-runtime -p opkit-gen -p opkit-testenv
	CARGO_PROFILE_DEV_DEBUG=false cargo package --locked --allow-dirty -q -p opkit-scaffold

.PHONY: fuzz
fuzz: ## Fuzz the cron parser for FUZZ_SECONDS (default 120); needs a nightly toolchain and cargo-fuzz
	cd fuzz && cargo +nightly fuzz run cron -- -max_total_time=$${FUZZ_SECONDS:-120}

.PHONY: testenv-build
testenv-build: ## Build (or find cached) the local control-plane binaries
	bash crates/testenv/scripts/build-binaries.sh

# The real-node tests (containerd, kubelet, kube-proxy; see README) run where the tests run as
# root, which they need; REAL_NODE=0 skips them.
REAL_NODE ?= $(if $(filter 0,$(shell id -u)),1,0)

.PHONY: test
test: testenv-build ## Run every test: unit tests and controller tests on the real local control plane (and real node, as root)
	OPKIT_TESTENV_REAL_NODE=$(REAL_NODE) cargo test --workspace

.PHONY: chaos
chaos: testenv-build ## Full chaos runs: two replicas (300 Memcacheds, 100 Ats; leader frozen/killed, apiserver/etcd restarted, etcd compacted, rolling restart, 429s, a hung connection), then three sharded replicas (3000 Memcacheds, 300 Ats; one killed, one frozen, two joining; then with slots: a rolling restart and a kill), one control plane at a time, then 60 s of connection floods (15000 idle probe connections), then a write cut off by a partition (iptables, root)
	OPKIT_CHAOS=full cargo test -p opkit-operator --test chaos -- --nocapture
	OPKIT_CHAOS=full cargo test -p opkit-operator --test sharded -- --nocapture --test-threads=1
	OPKIT_CHAOS=full cargo test -p opkit-operator --test webhooks -- a_flood --nocapture
	cargo test -p opkit-runtime --lib -- --ignored partition --nocapture

.PHONY: bench
bench: ## Benchmark opkit vs Go peers vs a direct client: BENCH=foo (sample-controller, N=300) or BENCH=memcached (controller-runtime, as scaffolded and tuned) or BENCH=fairness (a burst in one namespace, fair queue vs arrival order, N=10000); BENCH_REPEAT=3 for medians, BENCH_LANES=a,b for some lanes; e.g. make bench BENCH=memcached N=10000
	bash crates/testenv/scripts/build-binaries.sh --with-bench >/dev/null
	cargo build --release -p opkit-operator -p opkit-bench
	./target/release/opkit-bench

.PHONY: testenv-up
testenv-up: testenv-build ## Start the long-lived local control plane and print its KUBECONFIG; OPKIT_TESTENV_REAL_NODE=1 adds a real node (root)
	$(TESTENV) up

.PHONY: testenv-down
testenv-down: ## Stop the local control plane and remove its state
	$(TESTENV) down

.PHONY: install
install: ## Install the CRDs into the cluster of $KUBECONFIG
	$(OPKIT) crd | $(KUBECTL) apply --server-side -f -

.PHONY: uninstall
uninstall: ## Remove the CRDs (and every custom object) from the cluster of $KUBECONFIG
	$(OPKIT) crd | $(KUBECTL) delete --ignore-not-found -f -

.PHONY: run
run: ## Run the operator against the cluster of $KUBECONFIG
	$(OPKIT) run --metrics-bind-address 127.0.0.1:8080 --health-probe-bind-address 127.0.0.1:8081

.PHONY: dev
dev: ## Local control plane (if none is configured) + CRDs + samples + the operator
	bash hack/dev.sh

.PHONY: manifests
manifests: ## Regenerate config/ from the Rust code; NAMESPACES=a,b confines the operator to those (Roles, not a ClusterRole)
	$(OPKIT) manifests --dir config $(foreach n,$(subst $(comma), ,$(NAMESPACES)),--namespace $(n))

.PHONY: deploy
deploy: ## Deploy the operator (config/default) to the cluster of $KUBECONFIG, running image $(IMG)
	IMG=$(IMG) KUBECTL=$(KUBECTL) bash hack/render-default.sh | $(KUBECTL) apply --server-side -f -

INSTALLER ?= dist/install.yaml

.PHONY: build-installer
build-installer: ## Write $(INSTALLER) (dist/install.yaml): config/default in one file, running image $(IMG), for `kubectl apply -f`
	mkdir -p $(dir $(INSTALLER))
	IMG=$(IMG) KUBECTL=$(KUBECTL) bash hack/render-default.sh > $(INSTALLER).tmp
	mv $(INSTALLER).tmp $(INSTALLER)

.PHONY: undeploy
undeploy: ## Remove everything `make deploy` created (CRDs and custom objects included)
	$(KUBECTL) delete --ignore-not-found -k config/default

HELM ?= $(TESTENV_BIN_DIR)/helm
RELEASE ?= opkit
NAMESPACE ?= opkit-system

.PHONY: helm
helm: ## Regenerate the Helm chart dist/chart/ from the Rust code
	$(OPKIT) helm --dir dist/chart

.PHONY: helm-lint
helm-lint: testenv-build ## helm lint --strict dist/chart
	$(HELM) lint --strict dist/chart

.PHONY: helm-deploy
helm-deploy: testenv-build ## Install or upgrade the chart as $(RELEASE) in $(NAMESPACE), running image $(IMG); HELM_ARGS adds options (e.g. --set manager.replicas=2)
	img='$(IMG)'; $(HELM) upgrade --install $(RELEASE) dist/chart --namespace $(NAMESPACE) --create-namespace --wait \
		--set manager.image.repository=$${img%:*} --set manager.image.tag=$${img##*:} $(HELM_ARGS)

HELM_PACKAGE_DIR ?= dist

.PHONY: helm-package
helm-package: testenv-build ## Package dist/chart as $(HELM_PACKAGE_DIR)/opkit-<version>.tgz, for a chart repository or a release
	$(HELM) package dist/chart --destination $(HELM_PACKAGE_DIR)

.PHONY: helm-undeploy
helm-undeploy: testenv-build ## Uninstall the release $(RELEASE) (the CRDs stay unless installed with crd.keep=false)
	$(HELM) uninstall $(RELEASE) --namespace $(NAMESPACE) --wait

CHANNELS ?= candidate
DEFAULT_CHANNEL ?=
BUNDLE_IMG ?= opkit-bundle:v$(VERSION)

.PHONY: bundle
bundle: ## Write the OLM bundle (bundle/, bundle.Dockerfile) for VERSION, CHANNELS, DEFAULT_CHANNEL (first channel) and IMG (opkit:vVERSION)
	$(OPKIT) bundle --version $(VERSION) --channels $(CHANNELS) \
		$(if $(DEFAULT_CHANNEL),--default-channel $(DEFAULT_CHANNEL)) \
		$(if $(filter command line environment,$(origin IMG)),--image $(IMG))

.PHONY: bundle-validate
bundle-validate: testenv-build ## Check bundle/ with the operator-framework's validators (default, OperatorHub, good practices)
	$(TESTENV_BIN_DIR)/bundle-validate --k8s-version $$(sed -n 's/^KUBERNETES_VERSION=v\([0-9]*\.[0-9]*\).*/\1/p' crates/testenv/versions.env) bundle

.PHONY: bundle-build
bundle-build: ## Build the bundle image $(BUNDLE_IMG) with $(CONTAINER_TOOL)
	$(CONTAINER_TOOL) build -f bundle.Dockerfile -t $(BUNDLE_IMG) .

.PHONY: bundle-push
bundle-push: ## Push the bundle image $(BUNDLE_IMG)
	$(CONTAINER_TOOL) push $(call insecure,$(BUNDLE_IMG)) $(BUNDLE_IMG)

# The cargo profile of binaries built here for images (dev: a quick debug image).
PROFILE ?= release

.PHONY: docker-build
docker-build: ## Build the operator image $(IMG) with $(CONTAINER_TOOL); BASE=local (or an unpullable base) builds the $(PROFILE) binary here, on this machine's libraries
	IMG=$(IMG) BASE=$(BASE) PROFILE=$(PROFILE) CONTAINER_TOOL=$(CONTAINER_TOOL) bash hack/docker-build.sh

PLATFORMS ?= linux/amd64,linux/arm64

.PHONY: docker-buildx
docker-buildx: ## Build and push the operator image $(IMG) for each of $(PLATFORMS) as one multi-architecture image (binaries cross-compiled here; PROFILE=dev for debug ones)
	IMG=$(IMG) PACKAGE=opkit-operator BINARY=opkit PLATFORMS=$(PLATFORMS) PROFILE=$(PROFILE) BASE=$(BASE) CONTAINER_TOOL=$(CONTAINER_TOOL) \
		bash crates/testenv/scripts/docker-buildx.sh

.PHONY: docker-push
docker-push: ## Push the operator image $(IMG)
	$(CONTAINER_TOOL) push $(call insecure,$(IMG)) $(IMG)

.PHONY: testenv-load
testenv-load: ## Load the operator image $(IMG) into the local control plane's real node (as kind load does)
	IMG=$(IMG) CONTAINER_TOOL=$(CONTAINER_TOOL) bash hack/testenv-load.sh
