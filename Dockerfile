# gpt-server on the CPU. Build: docker build -t gpt-rs .
# Run:   docker run --rm -p 8080:8080 gpt-rs
# Own model: docker run --rm -p 8080:8080 -v $PWD/mymodel:/models/mymodel:ro \
#              -e GPT_SERVER_CHECKPOINT=/models/mymodel gpt-rs

FROM rust:1.95-slim-bookworm AS build
WORKDIR /src
# One COPY of the whole context (.dockerignore lets in only the sources and the model) and one
# RUN that leaves no target/ behind: where the engine stores layers without overlays (the vfs
# driver) every layer is a full copy of the file system, and the build needed three times the disk.
COPY . .
# The same command as .ci/run's build of the server; symbols stripped for a smaller image.
RUN cargo build --release --locked -p gpt-server -p gpt-train \
    && install -s -t /usr/local/bin target/release/gpt-server target/release/gpt-train \
    && rm -rf target "$CARGO_HOME/registry"

FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends curl \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/* /usr/share/doc/* /usr/share/man/* \
    && useradd --system --uid 10001 --home-dir /app gpt
WORKDIR /app
COPY --from=build /usr/local/bin/gpt-server /usr/local/bin/gpt-train /usr/local/bin/
COPY weights /app/weights
# Every flag of gpt-server can be set with these variables (see README: Flags).
ENV GPT_SERVER_HOST=0.0.0.0 \
    GPT_SERVER_PORT=8080 \
    GPT_SERVER_CHECKPOINT=/app/weights \
    GPT_SERVER_DEVICE=cpu
USER gpt
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD curl -fsS "http://127.0.0.1:${GPT_SERVER_PORT}/health" || exit 1
ENTRYPOINT ["gpt-server"]
