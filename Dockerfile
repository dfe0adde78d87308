# inferlb and the vLLM simulator in one small image.
#   docker build -t inferlb .
#   docker run -p 8000:8000 -v $PWD/config.toml:/etc/inferlb/config.toml inferlb --listen 0.0.0.0:8000
FROM rust:1.85-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p inferlb -p vllm-sim

FROM debian:bookworm-slim
RUN useradd --system --uid 10001 inferlb
COPY --from=build /src/target/release/inferlb /usr/local/bin/inferlb
COPY --from=build /src/target/release/vllm-sim /usr/local/bin/vllm-sim
COPY config.toml /etc/inferlb/config.toml
USER inferlb
EXPOSE 8000
ENTRYPOINT ["/usr/local/bin/inferlb", "--config", "/etc/inferlb/config.toml"]
