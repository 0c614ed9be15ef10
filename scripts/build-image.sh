#!/usr/bin/env bash
# Builds the repository's Dockerfile into an image without a Docker daemon or a registry, then
# runs the image's server from its own root filesystem and asks it one question with its own
# llava-chat. Needs root, Debian's buildah and debootstrap (installed if missing).
#
#   1. debootstrap a minimal Debian 12 and commit it as the local image docker.io/library/debian:12
#      (the Dockerfile's base; no registry is reachable from the build machines);
#   2. buildah bud --isolation chroot, vfs storage (no overlayfs or user namespaces needed);
#   3. mount the built image, chroot into it, start llava-server with the image's environment and
#      its default model, and run `llava-chat` against it.
#
# usage: scripts/build-image.sh [TAG]      (default localhost/llava-server:dev; `make image`)
# Takes ~7 minutes on 2 cores with buildah and debootstrap to install (the image's build stage,
# which compiles the server, 229 s in the fresh-clone CI run of 2026-12-02).
# Environment: WORK (default /var/tmp/llava-image) holds the base rootfs; MIRROR the Debian mirror.
set -euo pipefail
cd "$(dirname "$0")/.."
TAG=${1:-localhost/llava-server:dev}
WORK=${WORK:-/var/tmp/llava-image}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
BUILDAH=(buildah --storage-driver vfs)
log() { echo "build-image: $*" >&2; }

[ "$(id -u)" -eq 0 ] || { log "needs root (debootstrap, chroot)"; exit 1; }
missing=()
for tool in buildah debootstrap; do command -v "$tool" > /dev/null || missing+=("$tool"); done
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi

# 1. The base image.
if ! "${BUILDAH[@]}" inspect --type image docker.io/library/debian:12 > /dev/null 2>&1; then
  log "debootstrap bookworm (minbase) into $WORK/rootfs"
  rm -rf "$WORK/rootfs" && mkdir -p "$WORK"
  debootstrap --variant=minbase bookworm "$WORK/rootfs" "$MIRROR" > "$WORK/debootstrap.log"
  # The Dockerfile's apt-get needs the same sources a debian:12 image has.
  cat > "$WORK/rootfs/etc/apt/sources.list" <<EOF
deb $MIRROR bookworm main
deb $MIRROR bookworm-updates main
deb ${MIRROR%/debian}/debian-security bookworm-security main
EOF
  rm -rf "$WORK/rootfs/var/cache/apt/archives/"*.deb
  ctr=$("${BUILDAH[@]}" from scratch)
  mnt=$("${BUILDAH[@]}" mount "$ctr")
  cp -a "$WORK/rootfs/." "$mnt/"
  "${BUILDAH[@]}" umount "$ctr" > /dev/null
  "${BUILDAH[@]}" config --cmd /bin/bash --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$ctr"
  "${BUILDAH[@]}" commit --quiet "$ctr" docker.io/library/debian:12 > /dev/null
  "${BUILDAH[@]}" rm "$ctr" > /dev/null
  rm -rf "$WORK/rootfs"
fi

# 2. The image.
log "buildah bud -t $TAG (isolation chroot, vfs storage)"
start=$(date +%s)
"${BUILDAH[@]}" bud --isolation chroot --pull-never --layers=false --format docker -t "$TAG" \
  -f Dockerfile .
log "built $TAG in $(( $(date +%s) - start )) s"
# The docker format keeps the HEALTHCHECK (the OCI format has no field for it).
health=$("${BUILDAH[@]}" inspect --type image --format '{{.Docker.Config.Healthcheck}}' "$TAG")
case "$health" in *healthz*) ;; *) log "the image lost its HEALTHCHECK: $health"; exit 1 ;; esac

# 3. Run it: the entrypoint from the image's root filesystem, with the image's environment.
ctr=$("${BUILDAH[@]}" from --pull-never "$TAG")
mnt=$("${BUILDAH[@]}" mount "$ctr")
cleanup() {
  [ -n "${server_pid:-}" ] && kill "$server_pid" 2> /dev/null && wait "$server_pid" 2> /dev/null
  umount "$mnt/proc" 2> /dev/null || true
  "${BUILDAH[@]}" umount "$ctr" > /dev/null 2>&1 || true
  "${BUILDAH[@]}" rm "$ctr" > /dev/null 2>&1 || true
}
trap cleanup EXIT
mount -t proc proc "$mnt/proc"
env_args=()
while IFS= read -r kv; do env_args+=("$kv"); done < <(
  "${BUILDAH[@]}" inspect --type image --format '{{range .OCIv1.Config.Env}}{{println .}}{{end}}' "$TAG" | sed '/^$/d')
port=$((20000 + RANDOM % 20000))
env -i "${env_args[@]}" LLAVA_LISTEN="127.0.0.1:$port" LLAVA_METRICS_LISTEN="127.0.0.1:$((port + 1))" \
  LLAVA_HTTP_LISTEN="127.0.0.1:$((port + 2))" \
  chroot --userspec=65532:65532 "$mnt" llava-server > "$WORK/server.log" 2>&1 &
server_pid=$!
for _ in $(seq 120); do
  grep -q "serving on port" "$WORK/server.log" && break
  kill -0 "$server_pid" 2> /dev/null || { cat "$WORK/server.log"; log "the server exited"; exit 1; }
  sleep 1
done
answer=$(chroot "$mnt" llava-chat --server "127.0.0.1:$port" \
  --image /opt/llava/examples/scene1.png "How many objects are there?" 2>&1)
echo "$answer"
case "$answer" in *FINISH_REASON_STOP*|*FINISH_REASON_LENGTH*) ;; *) log "no answer"; exit 1 ;; esac
# The OpenAI-compatible API of the same server (curl from the host: same network namespace).
models=$(curl -sf "http://127.0.0.1:$((port + 2))/v1/models") || { log "no /v1/models"; exit 1; }
echo "$models"
case "$models" in *'"id":"shapes-llava"'*) ;; *) log "unexpected /v1/models"; exit 1 ;; esac
log "the image's server answered"
