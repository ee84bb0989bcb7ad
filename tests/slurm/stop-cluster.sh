#!/usr/bin/env bash
# Stop the cluster tests/slurm/start-cluster.sh DIR started: cancel its jobs, then stop slurmd, slurmctld
# and munged by their pid files in DIR (SIGTERM, SIGKILL after 10 s). Exits 1 if one is still alive.
set -uo pipefail

dir=${1:?usage: stop-cluster.sh DIR}
[ -d "$dir" ] || exit 0
export SLURM_CONF="$dir/slurm.conf"

alive() { [ -n "$1" ] && kill -0 "$1" 2>/dev/null; }
pid_of() { [ -s "$dir/$1.pid" ] && cat "$dir/$1.pid"; }

# Jobs first, while slurmctld and slurmd can still end their steps (slurmstepd outlives slurmd otherwise).
if alive "$(pid_of slurmctld)"; then
  jobs=$(squeue -h -o %i 2>/dev/null)
  if [ -n "$jobs" ]; then
    # shellcheck disable=SC2086
    scancel $jobs 2>/dev/null
    for _ in $(seq 1 40); do
      [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break
      sleep 0.5
    done
  fi
fi

status=0
# A step daemon of this cluster still running after its jobs were given 20 s: slurmd starts every slurmstepd
# in its log directory, which is this cluster's, so no other cluster's step is touched.
for pid in $(pgrep -x slurmstepd); do
  case "$(readlink "/proc/$pid/cwd" 2>/dev/null)" in
    "$dir"/*) kill -KILL "$pid" 2>/dev/null && echo "stop-cluster: killed slurmstepd $pid" >&2 ;;
  esac
done
# The daemons together (each takes 1.5-2 s to exit on SIGTERM), SIGKILL for any still running after 10 s.
pids=()
for daemon in slurmd slurmctld munged; do
  pid=$(pid_of "$daemon")
  alive "$pid" && kill -TERM "$pid" && pids+=("$daemon:$pid")
done
for _ in $(seq 1 100); do
  running=0
  for entry in "${pids[@]}"; do alive "${entry#*:}" && running=1; done
  [ "$running" = 0 ] && break
  sleep 0.1
done
for entry in "${pids[@]}"; do
  pid=${entry#*:}
  if alive "$pid"; then
    kill -KILL "$pid"
    sleep 0.2
  fi
  if alive "$pid"; then
    echo "stop-cluster: ${entry%%:*} (pid $pid) is still running" >&2
    status=1
  fi
done
exit $status
