# The opkit operator image: a release build on a minimal, non-root runtime.
# Build: make docker-build IMG=<registry>/opkit:<tag>   (hack/docker-build.sh)
#
# Build arguments and targets:
#   BASE             the runtime base (default distroless cc: glibc and libgcc only, no shell,
#                    no package manager). `make docker-build BASE=local` assembles an
#                    equivalent one from this machine's Debian libraries where no registry is
#                    reachable.
#   --target host    copy the binary `make build` made on this machine instead of compiling
#                    in the rust image (what BASE=local uses: that image cannot be pulled either).
ARG BASE=gcr.io/distroless/cc-debian12:nonroot

FROM rust:1.89-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p opkit-operator \
    && cp target/release/opkit /opkit

# Time zone data is compiled into the binary; uid/gid 65532 as in distroless' nonroot.
FROM ${BASE} AS runtime
USER 65532:65532
ENTRYPOINT ["/opkit"]
CMD ["run"]

FROM runtime AS host
COPY target/image/manager /opkit

# One platform of `make docker-buildx` (crates/testenv/scripts/docker-buildx.sh): the binary
# compiled for it on this machine.
FROM runtime AS host-cross
ARG TARGETARCH
COPY target/image/${TARGETARCH}/manager /opkit

# The default target: the binary compiled in the build stage.
FROM runtime
COPY --from=build /opkit /opkit
