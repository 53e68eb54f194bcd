#!/usr/bin/env bash
# What the later CI stages download, fetched while the workspace builds (.ci/run starts this in the
# background beside `cargo test --no-run`: the build keeps both cores busy, these wait on the
# network and the disk): Debian's packages for the MPI stage (Open MPI, libclang, iproute2; Slurm
# for its srun test), the browser stage (Chromium) and the Docker stage (the engine, compose,
# debootstrap), the Docker base images' root file systems (.ci/docker_base_images.sh
# --rootfs-only), and the Python environments of the guidellm, schemathesis and browser stages
# (each script with SETUP_ONLY=1). Each stage still installs what it finds missing, so that it
# runs alone too; this only moves the waiting earlier. The packages and root file systems need
# root (or sudo).
set -euo pipefail
cd "$(dirname "$0")/.."

start=$SECONDS
sudo= apt=yes
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then sudo=sudo; else apt=; fi
fi
if [ -n "$apt" ]; then
  $sudo apt-get update -q || echo "prefetch: apt-get update failed"
  # One group at a time: a group that cannot be installed (Slurm, whose test is then reported as
  # ignored) leaves the others installed.
  for group in "openmpi-bin libopenmpi-dev libclang-dev iproute2" "munge slurmctld slurmd slurm-client" \
    "chromium chromium-driver fonts-dejavu-core" "docker.io docker-compose debootstrap"; do
    # shellcheck disable=SC2086
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q $group || echo "prefetch: could not install $group"
  done
  $sudo apt-get clean  # (the archives: the disk is short on some CI machines)
  echo "prefetch: packages in $((SECONDS - start)) s"
fi
if [ "$(id -u)" = 0 ] && command -v debootstrap >/dev/null; then
  .ci/docker_base_images.sh --rootfs-only || echo "prefetch: the root file systems failed"
  echo "prefetch: root file systems by $((SECONDS - start)) s"
fi
for script in bench/guidellm.sh .ci/schemathesis.sh .ci/browser.sh; do
  SETUP_ONLY=1 bash "$script" || echo "prefetch: $script could not make its environment"
done
echo "prefetch: everything in $((SECONDS - start)) s"
