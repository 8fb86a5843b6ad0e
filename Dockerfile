# The opkit operator image: a static-ish release build on a minimal, non-root runtime.
# Build: make docker-build IMG=<registry>/opkit:<tag>
FROM rust:1.89-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p opkit-operator \
    && cp target/release/opkit /opkit

# glibc and libgcc only; no shell, no package manager. Time zone data is compiled into the binary.
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /opkit /opkit
USER 65532:65532
ENTRYPOINT ["/opkit"]
CMD ["run"]
