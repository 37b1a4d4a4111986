# Shared by the command-line tests: sourced with the test's own arguments
#   <tetra binary> <source dir> <scratch dir>
# it sets $tetra, $src and a fresh $scratch, and fail() counts a failure of the current $case;
# finish prints the verdict and exits.
set -u
tetra="$(realpath "$1")"
src="$(realpath "$2")"
scratch="$(realpath -m "$3")"
rm -rf "$scratch"
mkdir -p "$scratch"
failures=0
case=""
fail() { echo "FAIL [$case]: $*"; failures=$((failures + 1)); }
finish() {  # finish <what passed>
  if [[ $failures -ne 0 ]]; then echo "$failures failure(s)"; exit 1; fi
  echo "all $1 passed"
}
py=/usr/bin/python3  # Debian's, with numpy (whatever python3 comes first on PATH)

# with_mpi: for the tests that launch mpirun: it may run as root (containers, CI), one OpenMP
# thread per rank, and $mpirun is $MPIRUN or else mpirun.
with_mpi() {
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
  mpirun="${MPIRUN:-mpirun}"
}
