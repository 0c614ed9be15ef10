# Build and run llava-server on Debian 12 (gRPC :50051, OpenAI-compatible HTTP :8000, metrics :9090).
FROM debian:12 AS build
WORKDIR /src
COPY scripts/install-deps.sh scripts/install-deps.sh
RUN bash scripts/install-deps.sh --build-only
COPY . .
RUN cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DLLAVA_BUILD_TESTS=OFF -DLLAVA_BUILD_BENCH=OFF \
      -DLLAVA_BUILD_DEV_TOOLS=OFF -DLLAVA_BUILD_TRAIN=OFF \
      -DLLAVA_DEFAULT_MODEL_DIR=/opt/llava/models/shapes-llava \
 && cmake --build build -j"$(nproc)"

FROM debian:12
LABEL org.opencontainers.image.title="llava-server" \
      org.opencontainers.image.description="gRPC LLaVA chat service on libtorch with Elastic Cache KV compression" \
      org.opencontainers.image.base.name="debian:12"
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      libtorch1.13 libopenblas0-pthread libopencv-core406 libopencv-imgproc406 \
      libopencv-imgcodecs406 libspdlog1.10 libprotobuf32 libgrpc++1.51 libprometheus-cpp-core1.0 \
      libssl3 \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/build/llava-server /src/build/llava-chat /src/build/llava-generate \
     /src/build/llava-quantize /usr/local/bin/
COPY models/shapes-llava /opt/llava/models/shapes-llava
COPY models/examples /opt/llava/examples
# Unprivileged; deploy/kubernetes runs it as this UID with a read-only root filesystem.
RUN useradd --system --uid 65532 --no-create-home llava
USER 65532
EXPOSE 50051 8000 9090
# Settings as environment variables, not arguments: command-line flags would override the
# LLAVA_* values of deploy/kubernetes/configmap.yaml. One intra-op thread suits the default model.
ENV LLAVA_LISTEN=0.0.0.0:50051 LLAVA_HTTP_LISTEN=0.0.0.0:8000 LLAVA_METRICS_LISTEN=0.0.0.0:9090 \
    LLAVA_THREADS=1
# Docker's own health check reads /healthz on the metrics port (Kubernetes uses its probes).
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
  CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/${LLAVA_METRICS_LISTEN##*:} && printf 'GET /healthz HTTP/1.0\\r\\n\\r\\n' >&3 && head -c 12 <&3 | grep -q ' 200'"]
ENTRYPOINT ["llava-server"]
