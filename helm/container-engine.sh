#!/usr/bin/env bash
# Prints the container engine's command for helm/build-image.sh and `make image-check`:
# podman (no daemon needed; preferred), or docker where its daemon answers. Podman's default
# runtime (crun) fails here on setrlimit; runc works, so it is named where it is installed.
# On a root machine with apt and neither engine, Debian's podman is installed (one line), and
# catatonit where podman's pods lack it.
set -euo pipefail
if ! command -v podman >/dev/null 2>&1; then
  if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
    echo docker
    exit 0
  fi
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "no container engine: install podman (or start docker's daemon), then run this again" >&2
    exit 2
  fi
  echo "no container engine: installing Debian's podman (apt-get)" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends podman runc uidmap catatonit >/dev/null
fi
# A pod's infra container (podman kube play) runs catatonit: its image is built from it locally.
if ! command -v catatonit >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "podman's pods need catatonit: installing it (apt-get)" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends catatonit >/dev/null
fi
if command -v runc >/dev/null 2>&1; then
  echo podman --runtime runc
else
  echo podman
fi
