#!/usr/bin/env bash
# Builds the wanloom images from the repository's Dockerfiles with buildah (no Docker daemon), then starts each
# image's entry point once.
#
#   .ci/images/build.sh [operator] [tpu] [gpu]      (default: operator tpu)
#
# No registry is reachable from CI, so the Dockerfiles' base (python:3.11.14-slim-bookworm) is stood in for by a
# Debian bookworm root filesystem with Python 3.11 in a venv at /usr/local (the official image's layout), built by
# mmdebstrap and cached under ~/.cache/wanloom/images by the recipe's version. Builds run with --pull=never, so the
# stand-in is what FROM names. Users build the same Dockerfiles with Docker/BuildKit against the real base.
set -euo pipefail
cd "$(dirname "$0")/../.."

BASE_TAG=docker.io/library/python:3.11.14-slim-bookworm
# Bump when the stand-in's recipe below changes: the cache is keyed by it.
BASE_RECIPE=bookworm-py311-venv-1
CACHE=${WANLOOM_IMAGE_CACHE:-$HOME/.cache/wanloom/images}
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
# runc and cgroupfs: crun refuses this host's hybrid cgroups and there is no systemd; without CAP_SYS_RESOURCE the
# default ulimits must stay under the host's hard limits.
export CONTAINERS_CONF=$PWD/.ci/images/containers.conf
IMAGES=("$@")
[ ${#IMAGES[@]} -gt 0 ] || IMAGES=(operator tpu)

need() {
  local missing=()
  for tool in buildah podman mmdebstrap runc iptables; do command -v "$tool" >/dev/null || missing+=("$tool"); done
  [ ${#missing[@]} -eq 0 ] && return
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      buildah podman mmdebstrap runc containernetworking-plugins fuse-overlayfs uidmap iptables >/dev/null
  else
    echo "images: ${missing[*]} not installed (Debian: apt-get install buildah podman mmdebstrap runc)" >&2
    exit 1
  fi
}

base() {
  local tar=$CACHE/$BASE_RECIPE.tar
  if podman image exists "$BASE_TAG" && [ "$(podman image inspect -f '{{index .Labels "wanloom.recipe"}}' "$BASE_TAG" 2>/dev/null)" = "$BASE_RECIPE" ]; then
    return
  fi
  if [ ! -s "$tar" ]; then
    mkdir -p "$CACHE"
    echo "images: building the $BASE_TAG stand-in with mmdebstrap (~3 min)"
    mmdebstrap --quiet --variant=minbase \
      --include=python3,python3-venv,python-is-python3,ca-certificates,netbase,tzdata \
      --customize-hook='chroot "$1" python3 -m venv /usr/local' \
      bookworm "$CACHE/partial.tar"  # mmdebstrap picks the format from the name
    mv "$CACHE/partial.tar" "$tar"
  fi
  podman import --quiet \
    --change 'ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change "LABEL wanloom.recipe=$BASE_RECIPE" \
    --change 'CMD ["python3"]' \
    "$tar" "$BASE_TAG" >/dev/null
}

build() {
  local name=$1 tag=$2 mounts=()
  # Outbound TLS may pass an intercepting proxy whose CA only the host trusts: give pip the host's bundle.
  [ -f /etc/ssl/certs/ca-certificates.crt ] &&
    mounts=(-v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro)
  echo "images: building $tag"
  local start=$SECONDS
  buildah bud --quiet --pull=never --isolation=chroot --layers "${mounts[@]}" \
    -f "trainer_images/Dockerfile.$name" -t "$tag" . >/dev/null
  echo "images: $tag built in $((SECONDS - start)) s, $(podman image inspect -f '{{.Size}}' "$tag") bytes"
}

need
base
for name in "${IMAGES[@]}"; do
  case $name in
    operator) tag=ghcr.io/wanloom/wanloom-operator:$VERSION ;;
    tpu) tag=ghcr.io/wanloom/wanloom-trainer-tpu:$VERSION ;;
    gpu) tag=ghcr.io/wanloom/wanloom-trainer-gpu:$VERSION ;;
    *) echo "images: unknown image '$name' (valid: operator, tpu, gpu)" >&2; exit 2 ;;
  esac
  build "$name" "$tag"
done
# The images a rebuild replaced, so a CI host's storage stays at about one copy of each image.
podman image prune --force >/dev/null
