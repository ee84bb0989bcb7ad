#!/usr/bin/env bash
# A single-node Slurm cluster for the tests, as root: munged, slurmctld and slurmd, all state under DIR.
#
#   tests/slurm/start-cluster.sh DIR      then   export SLURM_CONF=DIR/slurm.conf
#   tests/slurm/stop-cluster.sh DIR       stops every daemon this started (pid files in DIR)
#
# Nothing outside DIR is touched: munged gets its own key and socket (slurm.conf's AuthInfo names it),
# the daemons their own ports, spool and state directories, so a system Slurm or munge is left alone.
# One node named after this host, with this host's CPUs, in one oversubscribable partition `debug`;
# no cgroups (proctrack/linuxproc, task/none), so it also runs in a container. Prints the SLURM_CONF line.
# Debian: apt-get install slurm-wlm munge.
set -euo pipefail

dir=${1:?usage: start-cluster.sh DIR}
for tool in munged slurmctld slurmd sinfo; do
  command -v "$tool" >/dev/null || { echo "start-cluster: $tool not found (Debian: apt-get install slurm-wlm munge)" >&2; exit 2; }
done
[ "$(id -u)" = 0 ] || { echo "start-cluster: must run as root (the daemons run as root here)" >&2; exit 2; }
if [ -e "$dir/slurm.conf" ]; then
  echo "start-cluster: $dir already holds a cluster; stop it first (tests/slurm/stop-cluster.sh $dir)" >&2
  exit 2
fi
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
mkdir -p "$dir/munge" "$dir/ctld" "$dir/spool" "$dir/log"
chmod 700 "$dir/munge"

# munge: a fresh 1024-byte key; --force because it runs as root and its socket lives outside /run/munge.
head -c 1024 /dev/urandom > "$dir/munge/munge.key"
chmod 400 "$dir/munge/munge.key"
munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" \
  --pid-file="$dir/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/munged.seed"

host=$(hostname -s)
cpus=$(nproc)
memory_mb=$(awk '/MemTotal/ {printf "%d", $2 / 1024 * 0.9}' /proc/meminfo)
# Two free TCP ports, so that a system slurmctld (6817) or another test cluster does not collide: the project's
# free_port_block, below the kernel's ephemeral range, so no outgoing connection takes one before slurmctld binds it
# (a fresh-clone CI run lost its cluster so: "Error binding slurm stream socket: Address already in use").
read -r ctld_port slurmd_port < <(PYTHONPATH="$(cd "$(dirname "$0")/../.." && pwd)" python3 -c '
from compare.machine.environment import free_port_block
base = free_port_block(2)
print(base, base + 1)')

cat > "$dir/slurm.conf" <<EOF
# Written by tests/slurm/start-cluster.sh: a single-node test cluster, state under $dir.
ClusterName=dpcompare-test
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
StateSaveLocation=$dir/ctld
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
# A cancelled step gets SIGTERM, then SIGKILL after KillWait seconds.
KillWait=10
# The node as written here, whatever slurmd detects (a VM may report hyperthreads as cores).
SlurmdParameters=config_overrides
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus Sockets=1 CoresPerSocket=$cpus ThreadsPerCore=1 RealMemory=$memory_mb State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF

export SLURM_CONF="$dir/slurm.conf"
slurmctld -c -f "$SLURM_CONF"   # -c: no state from an earlier cluster
slurmd -f "$SLURM_CONF" -N "$host"

for _ in $(seq 1 60); do
  state=$(sinfo -h -n "$host" -o %t 2>/dev/null || true)
  if [ "$state" = idle ]; then
    echo "export SLURM_CONF=$SLURM_CONF"
    exit 0
  fi
  sleep 0.5
done
echo "start-cluster: node $host is not idle after 30 s (sinfo says: ${state:-nothing}); see $dir/log" >&2
"$(dirname "$0")/stop-cluster.sh" "$dir" >&2 || true
exit 1
