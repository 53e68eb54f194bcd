#!/usr/bin/env bash
# Makes the base images the Dockerfiles name, where no registry can be reached: Debian bookworm
# from debootstrap (minbase), trimmed as the official slim image is (no docs, man pages, locales
# or apt lists), with this machine's CA bundle so TLS verifies inside containers as it does here:
#   debian:bookworm-slim     that root file system
#   rust:1.95-slim-bookworm  the same plus gcc, libc6-dev and this machine's Rust toolchain
#   nginx:bookworm           the same plus nginx-light (the load balancer of docker-compose.lb.yml)
# The root file systems are cached as tarballs in target/ci/docker between runs.
# Called by .ci/docker.sh; needs root and a running Docker engine. With --rootfs-only it makes
# the cached root file systems and nothing else (no engine needed: .ci/prefetch.sh, while the
# workspace builds).
set -euo pipefail
cd "$(dirname "$0")/.."
cache=target/ci/docker
mkdir -p "$cache"

# rootfs NAME PACKAGES: a cached tarball of a trimmed debootstrap with PACKAGES.
rootfs() {
  local name=$1 packages=$2 tarball=$cache/$1.tar
  if [ ! -f "$tarball" ]; then
    local dir
    dir=$(mktemp -d)
    debootstrap --variant=minbase ${packages:+--include=$packages} bookworm "$dir" http://deb.debian.org/debian >"$cache/$name-debootstrap.log" 2>&1 ||
      { tail -20 "$cache/$name-debootstrap.log"; exit 1; }
    rm -rf "$dir"/usr/share/doc/* "$dir"/usr/share/man/* "$dir"/usr/share/info/* "$dir"/var/lib/apt/lists/* \
      "$dir"/var/cache/apt/*.bin "$dir"/var/cache/apt/archives/*.deb "$dir"/etc/nginx/sites-enabled/default
    find "$dir"/var/log -type f -delete  # (directories stay: nginx writes its logs there)
    find "$dir"/usr/share/locale -mindepth 1 -maxdepth 1 ! -name 'locale.alias' -exec rm -rf {} +
    chmod 755 "$dir"  # mktemp's 0700 would become the image's / and lock out non-root users
    mkdir -p "$dir"/etc/ssl/certs
    cp /etc/ssl/certs/ca-certificates.crt "$dir"/etc/ssl/certs/ca-certificates.crt
    tar -C "$dir" -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
    rm -rf "$dir"
  fi
}

if [ "${1:-}" = --rootfs-only ]; then
  rootfs bookworm-slim ""
  rootfs bookworm-gcc gcc,libc6-dev
  rootfs bookworm-nginx nginx-light
  exit 0
fi

path=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
if ! docker image inspect debian:bookworm-slim >/dev/null 2>&1; then
  rootfs bookworm-slim ""
  docker import --change "ENV PATH=$path" --change 'CMD ["bash"]' "$cache/bookworm-slim.tar" debian:bookworm-slim
fi

if ! docker image inspect rust:1.95-slim-bookworm >/dev/null 2>&1; then
  rootfs bookworm-gcc gcc,libc6-dev
  # This machine's toolchain (rustc, cargo, the standard library), without its documentation.
  sysroot=$(rustc --print sysroot)
  dir=$(mktemp -d)
  chmod 755 "$dir"
  tar -C "$dir" -xf "$cache/bookworm-gcc.tar"
  mkdir -p "$dir/usr/local/rust"
  cp -a "$sysroot/bin" "$sysroot/lib" "$dir/usr/local/rust/"
  [ -d "$sysroot/libexec" ] && cp -a "$sysroot/libexec" "$dir/usr/local/rust/"
  tar -C "$dir" -c . | docker import --change "ENV PATH=/usr/local/rust/bin:$path" \
    --change "ENV CARGO_HOME=/usr/local/cargo" --change 'CMD ["bash"]' - rust:1.95-slim-bookworm
  rm -rf "$dir"
fi

if ! docker image inspect nginx:bookworm >/dev/null 2>&1; then
  rootfs bookworm-nginx nginx-light
  docker import --change "ENV PATH=$path" --change 'CMD ["nginx", "-g", "daemon off;"]' \
    "$cache/bookworm-nginx.tar" nginx:bookworm
fi
docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E 'bookworm' || true
