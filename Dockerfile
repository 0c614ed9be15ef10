# Build and run llava-elastic on Debian 12. The service issue turns the entrypoint into the
# gRPC server; for now the image runs the offline generator.
FROM debian:12 AS build
WORKDIR /src
COPY scripts/install-deps.sh scripts/install-deps.sh
RUN bash scripts/install-deps.sh
COPY . .
RUN cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DLLAVA_BUILD_TESTS=OFF \
      -DLLAVA_DEFAULT_MODEL_DIR=/opt/llava/models/default \
 && cmake --build build -j"$(nproc)"

FROM debian:12
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      libtorch1.13 libopenblas0-pthread libopencv-core406 libopencv-imgproc406 \
      libopencv-imgcodecs406 libspdlog1.10 libprotobuf32 \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/build/llava-generate /src/build/llava-tokenize /usr/local/bin/
COPY --from=build /src/build/tiny-model /opt/llava/models/default
COPY models/examples /opt/llava/examples
ENTRYPOINT ["llava-generate"]
CMD ["--image", "/opt/llava/examples/shapes.png", "--prompt", "What is in the image?"]
