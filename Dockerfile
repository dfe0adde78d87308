# inferlb and the vLLM simulator in one small image.
#   docker build -t inferlb .
#   docker run -p 8000:8000 inferlb --backend http://vllm-host:8000
#   docker run -p 8001:8001 --entrypoint vllm-sim inferlb --host 0.0.0.0 --port 8001
# The default config is the repository's config.toml (/etc/inferlb/config.toml); mount your
# own over it (-v $PWD/config.toml:/etc/inferlb/config.toml:ro). INFERLB_LISTEN puts the
# listener on 0.0.0.0:8000 inside the container whatever the file says.
#
# Build stage: Debian 13's own Rust toolchain, rustc/cargo 1.85.1, which is exactly the
# workspace's declared rust-version — so building this image is also the MSRV check
# (deploy/check-msrv.sh). --locked: the committed Cargo.lock, never a fresh resolution.
FROM debian:trixie-slim AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends cargo rustc gcc libc6-dev ca-certificates \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# BUILD_CA_FILE: only for builds behind a TLS-intercepting proxy (a PEM bundle mounted into the
# build); empty by default and never part of the image.
ARG BUILD_CA_FILE=
RUN if [ -n "$BUILD_CA_FILE" ]; then export CARGO_HTTP_CAINFO="$BUILD_CA_FILE"; fi \
 && cargo --version && rustc --version \
 && cargo build --profile dist --locked -p inferlb -p vllm-sim \
 && strip target/dist/inferlb target/dist/vllm-sim \
 && install -m 0755 target/dist/inferlb target/dist/vllm-sim /usr/local/bin/ \
 && rm -rf target /root/.cargo/registry /root/.cargo/git
# (target/ is removed in the same step: the build stage's layer would otherwise hold ~2 GB of
# build output — a first build here failed writing that layer to a nearly full disk.)

# Runtime stage: the two binaries, the default config, an unprivileged user. No shell tools
# beyond the base image's: the health check talks HTTP/1.0 through bash's /dev/tcp
# to the port INFERLB_LISTEN names.
FROM debian:trixie-slim
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin inferlb
COPY --from=build /usr/local/bin/inferlb /usr/local/bin/vllm-sim /usr/local/bin/
COPY config.toml /etc/inferlb/config.toml
ENV INFERLB_LISTEN=0.0.0.0:8000
USER 10001:10001
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
  CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/${INFERLB_LISTEN##*:} && printf 'GET /health HTTP/1.0\\r\\n\\r\\n' >&3 && head -n1 <&3 | grep -q ' 200 '"]
ENTRYPOINT ["/usr/local/bin/inferlb", "--config", "/etc/inferlb/config.toml"]
