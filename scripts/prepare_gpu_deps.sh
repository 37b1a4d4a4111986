#!/usr/bin/env bash
# Prepares, on a Debian machine with apt, a folder of the headers, CMake/pkg-config files and
# shared libraries that building Tetra needs, for a GPU machine that has CUDA (nvcc, cuBLASLt,
# cuDNN, NCCL), a compiler and CMake but not our Debian packages, and no network. scripts/
# gpu_check.sh then builds with it (CMAKE_PREFIX_PATH, PKG_CONFIG_PATH, LD_LIBRARY_PATH).
#
# Nothing is installed here: each package is fetched with `apt-get download` and unpacked with
# `dpkg -x` into DIR (DIR/usr/include, DIR/usr/lib/..., DIR/usr/bin). The list is the closure of
# the build's -dev packages over their dependencies, less what every Linux with a C++ compiler has
# (libc, libstdc++, libgcc, libgomp, zlib). pkg-config files are made relocatable (their prefix
# becomes ${pcfiledir}/...), so DIR can move. Documentation is dropped.
#
# What goes in, and how big (Debian 12, measured): the GPU machine receives at most 64 MiB of
# carried files, the source tree (~1.5 MiB) included, so the folder travels as DIR.tar.xz, which
# gpu_check.sh unpacks:
#                 unpacked   .tar.xz
#   always         49 MiB     12 MiB   nlohmann-json, spdlog + fmt, CLI11, Catch2, sentencepiece,
#                                      PCRE2, pkgconf and ICU (libicu-dev, libicu72: its data library
#                                      alone is 30 MiB; static archives are dropped)
#   oneDNN        +41 MiB     ~8 MiB   libdnnl (+ the OpenCL headers its CMake config requires);
#                                      --no-dnnl leaves it out: the CPU backend then multiplies with
#                                      the loop GEMM (kernels/cpu/gemm_loops.cpp), fine for the
#                                      CUDA tests' CPU references, slow for CPU training
#   --with-mpi    +31 MiB     ~6 MiB   OpenMPI 4.1 (mpirun, libmpi, headers, PMIx, UCX, libfabric);
#                                      only useful with several GPUs (NCCL needs one per rank)
#   all three     121 MiB    ~26 MiB   (ICU measured with --no-dnnl; the other rows before ICU)
# The script prints the sizes it made. --no-archive skips the .tar.xz (xz takes a minute or more).
#
# Usage: scripts/prepare_gpu_deps.sh DIR [--no-dnnl] [--with-mpi] [--no-archive]
set -euo pipefail

usage() { echo "usage: $0 DIR [--no-dnnl] [--with-mpi] [--no-archive]" >&2; exit 2; }
[ $# -ge 1 ] || usage
DIR=$1
shift
WITH_DNNL=1
WITH_MPI=0
ARCHIVE=1
for a in "$@"; do
  case "$a" in
    --no-dnnl) WITH_DNNL=0 ;;
    --with-mpi) WITH_MPI=1 ;;
    --no-archive) ARCHIVE=0 ;;
    *) usage ;;
  esac
done
command -v apt-get >/dev/null && command -v dpkg >/dev/null || { echo "prepare_gpu_deps: needs apt-get and dpkg (a Debian machine)" >&2; exit 1; }

# (ICU: CMakeLists.txt requires icu-uc, for the tokenizers' Unicode normalisation and categories.)
BASE=(nlohmann-json3-dev libspdlog-dev libfmt-dev libcli11-dev catch2 libsentencepiece-dev libpcre2-dev libicu-dev
      pkgconf)
DNNL=(libdnnl-dev ocl-icd-opencl-dev)
# OpenMPI's runtime closure, less optional hwloc plugins (they pull in libxml2 and X11).
MPI_ROOTS=(openmpi-bin libopenmpi3)
MPI_EXTRA=(libopenmpi-dev)  # headers and the mpicc wrapper; not its dependencies (compilers)
EXCLUDE='^(libc6|libc6-dev|libc-dev|libgcc-s1|libstdc\+\+6|libgomp1|gcc-[0-9]+-base|zlib1g|dpkg|debconf|perl|perl-base|openssh-client|adduser|passwd|libssl3|libudev1|libselinux1|libzstd1|liblzma5|libhwloc-plugins|libxml2|libx11-.*|libx11-6|libxau6|libxcb1|libxdmcp6|libxext6|libxnvctrl0|libbsd0|libmd0)$'

direct_deps() {
  apt-cache depends --no-recommends --no-suggests --no-conflicts --no-breaks --no-replaces --no-enhances "$@" \
    2>/dev/null | awk '$1 ~ /Depends:/ && $2 !~ /^</ {print $2}' | sort -u
}

# The packages and everything they depend on, to a fixed point, less EXCLUDE.
closure() {
  local set new
  set=$(printf '%s\n' "$@" | sort -u)
  while :; do
    new=$( (echo "$set"; direct_deps $set | grep -Ev "$EXCLUDE" || true) | sort -u)
    [ "$new" = "$set" ] && break
    set=$new
  done
  echo "$set"
}

# apt's lists may be missing (a fresh machine): refresh them once if a package has no candidate.
if ! apt-cache policy libfmt-dev 2>/dev/null | grep -q 'Candidate: [0-9]'; then
  echo "prepare_gpu_deps: refreshing apt's package lists"
  apt-get update -qq
fi

PACKAGES=$(closure "${BASE[@]}")
[ $WITH_DNNL = 1 ] && PACKAGES=$(printf '%s\n' $PACKAGES $(closure "${DNNL[@]}") | sort -u)
[ $WITH_MPI = 1 ] && PACKAGES=$(printf '%s\n' $PACKAGES $(closure "${MPI_ROOTS[@]}") "${MPI_EXTRA[@]}" | sort -u)

mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
DEBS=$(mktemp -d "${TMPDIR:-/tmp}/tetra-gpu-deps.XXXXXX")
chmod a+rwx "$DEBS"  # apt-get download runs as the _apt user where it can
trap 'rm -rf "$DEBS"' EXIT
echo "prepare_gpu_deps: fetching $(echo $PACKAGES | wc -w) packages: $(echo $PACKAGES)"
(cd "$DEBS" && apt-get download -qq $PACKAGES)
for deb in "$DEBS"/*.deb; do dpkg -x "$deb" "$DIR"; done
rm -rf "$DIR/usr/share/doc" "$DIR/usr/share/man" "$DIR/usr/share/lintian" "$DIR/usr/share/info"
# The build links the shared libraries: the static archives (ICU's alone are 42 MiB) stay behind.
find "$DIR" -name '*.a' -delete

# pkg-config files name prefix=/usr: make them relative to where they lie.
while IFS= read -r pc; do
  case "$pc" in
    */usr/lib/*/pkgconfig/*) up='${pcfiledir}/../../..' ;;
    */usr/lib/pkgconfig/*|*/usr/share/pkgconfig/*) up='${pcfiledir}/../..' ;;
    *) continue ;;
  esac
  sed -i "s|^prefix=/usr\$|prefix=$up|" "$pc"
done < <(find "$DIR" -name '*.pc')

{
  echo "# scripts/prepare_gpu_deps.sh $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(. /etc/os-release && echo "$PRETTY_NAME")"
  echo "# with-dnnl=$WITH_DNNL with-mpi=$WITH_MPI"
  for deb in "$DEBS"/*.deb; do dpkg-deb -f "$deb" Package Version | paste -s -d ' '; done
} >"$DIR/PACKAGES.txt"

echo "prepare_gpu_deps: $DIR holds $(du -sh "$DIR" | cut -f1) ($(du -sb "$DIR" | cut -f1) bytes)" \
     "(oneDNN: $([ $WITH_DNNL = 1 ] && echo yes || echo no), OpenMPI: $([ $WITH_MPI = 1 ] && echo yes || echo no))"
if [ $ARCHIVE = 1 ]; then
  tar -C "$(dirname "$DIR")" -cf - "$(basename "$DIR")" | xz -T0 -6 >"$DIR.tar.xz"
  echo "prepare_gpu_deps: $DIR.tar.xz: $(du -sh "$DIR.tar.xz" | cut -f1) ($(du -sb "$DIR.tar.xz" | cut -f1) bytes)"
fi
