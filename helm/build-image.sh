#!/usr/bin/env bash
# `make image`: helm/Dockerfile's CPU variant as images, TAG (default kvmesh:cpu) and TAG-vllm.
# Where the registry's base image cannot be pulled, a stand-in is made once from Debian's own
# mirror with debootstrap (bookworm, Python 3.11: what the registry's image is) and cached.
# Where this machine's pip has a wheel folder or a certificate of its own (a proxy's), they
# are mounted into the build (podman) and passed as PIP_OPTIONS (the certificate to uv as CA_FILE), and torch comes from pip's
# own sources; elsewhere the Dockerfile's defaults apply. Prints the images' sizes and build
# times and writes them to results/image.json.
set -euo pipefail
cd "$(dirname "$0")/.."
ENGINE=$(helm/container-engine.sh)
TAG=${1:-kvmesh:cpu}
REGISTRY_BASE=python:3.11-slim-bookworm
STANDIN=localhost/kvmesh-base:bookworm
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/kvmesh

has_image() { $ENGINE image inspect "$1" >/dev/null 2>&1; }

base_image() {
  if has_image "$REGISTRY_BASE" || timeout 60 $ENGINE pull -q "$REGISTRY_BASE" >/dev/null 2>&1; then
    echo "$REGISTRY_BASE"
    return
  fi
  if ! has_image "$STANDIN"; then
    local tarball=$CACHE/base-bookworm.tar
    if [ ! -s "$tarball" ]; then
      echo "$REGISTRY_BASE cannot be pulled: making a stand-in from Debian bookworm with debootstrap (once, cached in $CACHE)" >&2
      command -v debootstrap >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
      local root
      root=$(mktemp -d)
      debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        bookworm "$root" http://deb.debian.org/debian >/dev/null
      rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin
      mkdir -p "$CACHE"
      tar -C "$root" -cf "$tarball.part" . && mv "$tarball.part" "$tarball"
      rm -rf "$root"
    fi
    $ENGINE import "$tarball" "$STANDIN" >/dev/null
  fi
  echo "$STANDIN"
}

# One of this machine's pip settings: its environment's, else its config files'.
pip_setting() {
  local value="${!1:-}"
  [ -n "$value" ] || value=$(python3 -m pip config list 2>/dev/null | sed -n "s/^[^=]*\.$2='\(.*\)'\$/\1/p" | head -1)
  echo "$value"
}

BASE=$(base_image)
args=(--build-arg "BASE=$BASE" --build-arg VARIANT=cpu)
mounts=()
pip_options=""
if [ "${ENGINE%% *}" = podman ]; then
  wheels=$(pip_setting PIP_FIND_LINKS find-links)
  cert=$(pip_setting PIP_CERT cert)
  if [ -n "$wheels" ] && [ -d "$wheels" ]; then
    mounts+=(-v "$wheels:/run/kvmesh-wheels:ro")
    pip_options+=" --find-links /run/kvmesh-wheels"
    if compgen -G "$wheels/torch-2.13.0*.whl" >/dev/null; then
      args+=(--build-arg "TORCH_INDEX_URL=")  # the CPU torch wheel is in the folder
    fi
  fi
  if [ -n "$cert" ] && [ -f "$cert" ]; then
    mounts+=(-v "$cert:/run/kvmesh-ca.crt:ro")
    pip_options+=" --cert /run/kvmesh-ca.crt"
    args+=(--build-arg CA_FILE=/run/kvmesh-ca.crt)
  fi
fi
[ -z "$pip_options" ] || args+=(--build-arg "PIP_OPTIONS=${pip_options# }")
# Both variants from one build: TAG (kvmesh's engine) and TAG-vllm (vLLM beside it, for models
# on engine kind vllm: the chart's image.vllm); the second reuses the first's layers.
build() {  # tag, more build flags
  local tag=$1 started
  shift
  started=$(date +%s)
  echo "building $tag with ${ENGINE%% *} on $BASE" >&2
  $ENGINE build --network host "${mounts[@]}" "${args[@]}" "$@" -f helm/Dockerfile -t "$tag" . >&2
  local seconds=$(($(date +%s) - started)) size
  size=$($ENGINE image inspect "$tag" --format '{{.Size}}')
  echo "$tag: $((size / 1000000)) MB, built in ${seconds} s on $BASE" >&2
  printf '{"tag": "%s", "engine": "%s", "base": "%s", "size_bytes": %s, "build_seconds": %s}' \
    "$tag" "${ENGINE%% *}" "$BASE" "$size" "$seconds"
}
mkdir -p results
kvmesh=$(build "$TAG")
vllm=$(build "$TAG-vllm" --target vllm)
printf '{"images": [%s, %s]}\n' "$kvmesh" "$vllm" > results/image.json
echo "results/image.json"
