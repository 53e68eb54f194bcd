#!/usr/bin/env bash
# Docker, for real: starts a Docker engine if none runs (Debian's docker.io, without the
# privileges this kind of machine lacks: no iptables, no bridge, vfs storage), makes the base
# images locally (.ci/docker_base_images.sh: no registry here), builds the unchanged Dockerfile,
# and runs the image as the README says: /health, the openai client (completions and chat)
# through the container's port, a non-root user, a `healthy` HEALTHCHECK, a mounted checkpoint,
# `docker stop` ending it with exit code 0. Then docker-compose.yml serves the default model, and
# docker-compose.lb.yml's two replicas behind nginx take 32 concurrent requests, both answering,
# and lose no request sent after one of them is killed (tests/docker/lb_check.py).
# Rerun alone with `.ci/docker.sh` (root).
set -euo pipefail
cd "$(dirname "$0")/.."
out=target/ci/docker
mkdir -p "$out"
[ "$(id -u)" = 0 ] || { echo ".ci/docker.sh needs root (apt-get, dockerd, debootstrap)"; exit 1; }

need=()
command -v dockerd >/dev/null || need+=(docker.io)
command -v debootstrap >/dev/null || need+=(debootstrap)
command -v docker-compose >/dev/null || need+=(docker-compose)
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}"
fi
# The engine's own containerd, started first and waited for: dockerd gives the containerd it
# starts itself 15 s, and on a loaded CI machine that once was not enough ("timeout waiting for
# containerd to start"). Fresh directories of its own, so that no earlier daemon's lock on its
# database can hold it up, and three tries before giving up.
start_engine() {
  local root=/var/lib/gpt-ci-docker run=/run/gpt-ci-docker attempt
  local sock=$run/containerd/containerd.sock
  for attempt in 1 2 3; do
    mkdir -p "$root" "$run"
    containerd --root "$root/containerd" --state "$run/containerd" --address "$sock" \
      >"$out/containerd.log" 2>&1 &
    for _ in $(seq 120); do ctr --address "$sock" version >/dev/null 2>&1 && break; sleep 1; done
    if ctr --address "$sock" version >/dev/null 2>&1; then
      dockerd --containerd="$sock" --data-root "$root/docker" --exec-root "$run/docker" \
        --pidfile "$run/dockerd.pid" --iptables=false --bridge=none --storage-driver=vfs \
        >"$out/dockerd.log" 2>&1 &
      for _ in $(seq 120); do docker info >/dev/null 2>&1 && return 0; sleep 1; done
    fi
    echo "Docker engine, try $attempt: not up after 120 s"
    tail -15 "$out/containerd.log" "$out/dockerd.log" 2>/dev/null || true
    pkill -f "dockerd --containerd=$sock" || true
    pkill -f "containerd --root $root/containerd" || true
    sleep 5
    rm -rf "$run"
  done
  return 1
}
if ! docker info >/dev/null 2>&1; then
  start_engine || { echo "no Docker engine could be started"; exit 1; }
fi
.ci/docker_base_images.sh

venv=${DOCKER_CHECK_VENV:-target/ci/venv-docker}
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import openai" 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check openai
fi

# The build, as a user runs it (crates fetched over the host's network).
start=$(date +%s)
docker build --network host --force-rm -t gpt-rs . >"$out/build.log" 2>&1 ||
  { tail -40 "$out/build.log"; df -h . /var/lib; exit 1; }
size=$(docker image inspect gpt-rs --format '{{.Size}}')
# The build stage's layers, untagged once the image is built, are full copies under vfs: freed now.
docker image prune -f >/dev/null
echo "docker build: $(( $(date +%s) - start )) s; image gpt-rs: $(( size / 1000000 )) MB;" \
  "$(df -h --output=avail . | tail -1 | tr -d ' ') free"

cleanup() {
  docker rm -f gpt-ci gpt-ci-mounted >/dev/null 2>&1 || true
  docker-compose -p gptci -f "$out/docker-compose.host.yml" --project-directory . down >/dev/null 2>&1 || true
  docker-compose -p gptcilb -f docker-compose.lb.yml down >/dev/null 2>&1 || true
  docker image prune -f >/dev/null 2>&1 || true  # the build's intermediate layers (vfs: full copies)
}
trap cleanup EXIT
wait_health() { # URL
  for _ in $(seq 100); do curl -sf "$1/health" >/dev/null && return 0; sleep 0.3; done
  echo "no answer from $1/health"; return 1
}

# The image as the README runs it (host network here: the engine has no bridge).
docker run -d --name gpt-ci --network host -e GPT_SERVER_PORT=18190 gpt-rs >/dev/null
wait_health http://127.0.0.1:18190
"$venv/bin/python" tests/docker/openai_smoke.py http://127.0.0.1:18190/v1
uid=$(docker exec gpt-ci id -u)
[ "$uid" != 0 ] || { echo "the server runs as root"; exit 1; }
for _ in $(seq 60); do
  health=$(docker inspect -f '{{.State.Health.Status}}' gpt-ci)
  [ "$health" = healthy ] && break
  sleep 1
done
[ "$health" = healthy ] || { echo "HEALTHCHECK says $health"; docker inspect gpt-ci | tail -30; exit 1; }
start=$(date +%s)
docker stop gpt-ci >/dev/null
code=$(docker inspect -f '{{.State.ExitCode}}' gpt-ci)
[ "$code" = 0 ] || { echo "docker stop: exit code $code"; docker logs gpt-ci | tail; exit 1; }
echo "image: uid $uid, $health, docker stop -> exit 0 in $(( $(date +%s) - start )) s"

# A mounted checkpoint named by GPT_SERVER_CHECKPOINT.
docker run -d --name gpt-ci-mounted --network host -e GPT_SERVER_PORT=18191 \
  -v "$PWD/tests/fixtures/tiny-gpt2:/models/tiny:ro" -e GPT_SERVER_CHECKPOINT=/models/tiny gpt-rs >/dev/null
wait_health http://127.0.0.1:18191
models=$(curl -sf http://127.0.0.1:18191/v1/models)
echo "$models" | grep -q '"id":"tiny"' || { echo "the mounted checkpoint is not served: $models"; exit 1; }
docker rm -f gpt-ci-mounted >/dev/null
echo "mounted checkpoint served as 'tiny'"

# docker-compose.yml serves the default model. This engine has no bridge network, so its services
# run on the host network here, their published ports dropped (Docker refuses both at once).
python3 - docker-compose.yml "$out/docker-compose.host.yml" <<'PY'
import sys, yaml
compose = yaml.safe_load(open(sys.argv[1]))
for service in compose["services"].values():
    service.pop("ports", None)
    service["network_mode"] = "host"
yaml.safe_dump(compose, open(sys.argv[2], "w"))
PY
compose=(docker-compose -p gptci -f "$out/docker-compose.host.yml" --project-directory .)
"${compose[@]}" up -d --no-build
wait_health http://127.0.0.1:8080
curl -sf http://127.0.0.1:8080/v1/models | grep -q '"id":"default"'
"${compose[@]}" down
echo "docker-compose up: the default model on :8080"

# Replicas behind the balancer.
docker-compose -p gptcilb -f docker-compose.lb.yml up -d --no-build
for port in 8081 8082 8080; do wait_health http://127.0.0.1:$port; done
python3 tests/docker/lb_check.py http://127.0.0.1:8080 8081 8082 "docker-compose -p gptcilb -f docker-compose.lb.yml kill gpt-server-2"
