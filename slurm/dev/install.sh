#!/usr/bin/env bash
# Debian packages of the dev cluster (Slurm 22.05, slurmdbd, munge, MariaDB, PMIx; iproute2 for its
# hosts' network namespaces, util-linux's nsenter/unshare); idempotent.
set -euo pipefail
need=()
for bin in slurmctld slurmd slurmdbd munged mariadbd sacctmgr ip nsenter unshare; do
  command -v "$bin" >/dev/null 2>&1 || need+=("$bin")
done
[[ ${#need[@]} -eq 0 ]] && exit 0
pkgs=(slurm-wlm slurmdbd munge mariadb-server libpmix2 libpmix-dev iproute2 util-linux)
export DEBIAN_FRONTEND=noninteractive
SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
if ! $SUDO apt-get install -y --no-install-recommends "${pkgs[@]}" >/dev/null; then
  $SUDO apt-get update -qq
  $SUDO apt-get install -y --no-install-recommends "${pkgs[@]}" >/dev/null
fi
