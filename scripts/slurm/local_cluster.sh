#!/usr/bin/env bash
# A single-node Slurm on localhost, for the tests (and for trying the sbatch script by hand):
#   scripts/slurm/local_cluster.sh start <dir>   prints "export SLURM_CONF=<dir>/slurm.conf"
#   scripts/slurm/local_cluster.sh stop <dir>
# Everything (config, state, spool, logs, pid files) lives under <dir>; nothing outside it is
# touched, and no systemd is needed. Runs as root (SlurmUser=root); the daemons come from Debian's
# slurmctld and slurmd (scripts/setup.sh installs them).
#
# The recipe is measured (the Slurm notes in the repository's shared notes): auth/none and
# cred/none instead of munge (Slurm 22.05 accepts them: no key, no munged); the node declared
# with CPUs=8 and SlurmdParameters=config_overrides so 8 tasks fit on a 2-core machine (with an
# honest CPU count they wait in the queue forever); batch_sched_delay=0 so batch jobs start in
# 1-3 s; MpiDefault=pmix, the only MPI plugin that starts Debian's OpenMPI programs. The two ports
# are chosen free at start, so two clusters (two test runs) can live side by side.
set -euo pipefail

cmd="${1:-}"
dir="${2:-}"
if [[ -z "$cmd" || -z "$dir" ]]; then
  echo "usage: $0 start|stop <dir>" >&2
  exit 2
fi
mkdir -p "$dir"
dir="$(realpath "$dir")"
conf="$dir/slurm.conf"

die() { echo "local_cluster: $*" >&2; exit 1; }

port_free() { ! ss -Htln "sport = :$1" 2>/dev/null | grep -q .; }

stop_pid_file() {  # stop_pid_file <file>: SIGTERM, then wait (at most 10 s) until gone or a zombie
  local f="$1" pid state
  [[ -f "$f" ]] || return 0
  pid=$(cat "$f")
  [[ -n "$pid" ]] || return 0
  kill "$pid" 2>/dev/null || return 0
  for _ in $(seq 100); do
    state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null || echo gone)
    [[ "$state" == gone || "$state" == Z ]] && return 0
    sleep 0.1
  done
  kill -9 "$pid" 2>/dev/null || true
}

case "$cmd" in
  start)
    for tool in slurmctld slurmd scontrol sinfo; do
      command -v "$tool" >/dev/null || die "$tool not found: run scripts/setup.sh (installs slurmctld slurmd slurm-client)"
    done
    [[ -e /usr/lib/x86_64-linux-gnu/libpmix.so || -n "$(ldconfig -p | grep 'libpmix.so ')" ]] ||
      die "libpmix.so (package libpmix-dev) is missing: Slurm's pmix plugin cannot load; run scripts/setup.sh"
    host="$(hostname -s)"
    port=$((20000 + ($$ % 2000) * 2))
    while ! port_free "$port" || ! port_free $((port + 1)); do port=$((port + 2)); done
    mkdir -p "$dir/state" "$dir/spool"
    cat >"$conf" <<CONF
ClusterName=tetra
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$port
SlurmdPort=$((port + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerParameters=batch_sched_delay=0
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MailProg=/bin/true
MpiDefault=pmix
ReturnToService=2
SlurmdParameters=config_overrides
JobRequeue=1
KillWait=5
NodeName=$host NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
    export SLURM_CONF="$conf"
    slurmctld -c -f "$conf" || die "slurmctld did not start: $(tail -5 "$dir/slurmctld.log" 2>/dev/null)"
    for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.1; done
    scontrol ping 2>/dev/null | grep -q UP || die "slurmctld is not UP after 10 s: $(tail -5 "$dir/slurmctld.log")"
    slurmd -f "$conf" || die "slurmd did not start: $(tail -5 "$dir/slurmd.log" 2>/dev/null)"
    for _ in $(seq 200); do [[ "$(sinfo -h -N -o %T 2>/dev/null)" == idle ]] && break; sleep 0.1; done
    [[ "$(sinfo -h -N -o %T)" == idle ]] ||
      die "the node is not idle after 20 s ($(sinfo -h -N -o %T)): $(tail -5 "$dir/slurmd.log")"
    echo "export SLURM_CONF=$conf"
    ;;
  stop)
    [[ -f "$conf" ]] && SLURM_CONF="$conf" scancel --full --user=root >/dev/null 2>&1 || true
    stop_pid_file "$dir/slurmd.pid"
    stop_pid_file "$dir/slurmctld.pid"
    ;;
  *)
    die "unknown command '$cmd' (start | stop)"
    ;;
esac
