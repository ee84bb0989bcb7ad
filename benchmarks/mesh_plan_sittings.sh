#!/bin/bash
# Issue 37's plan check, K sittings in a row on this machine, then each mesh's median error over them:
#
#   bash benchmarks/mesh_plan_sittings.sh KEEP [K]      (K: 3 by default; about 8 minutes a sitting on 2 cores)
#
# A sitting, per framework: ddp, fsdp, tp and pp at N=1 and 2 on loopback (the axes' fits), then the meshes at
# N=4 over 100mbit between groups of two ranks on 1gbit, then on loopback, each fitted on the sitting's own N=2
# runs. MLX's fits are trained on ring and again on MPI, the backend its meshes run on; the end prints both.
# One sitting is no verdict: a machine's N=1 runs move as much as the 20 % target between minutes (docs/scaling.md,
# "Sitting 7"), so the check is the median over sittings. Kept under KEEP as FRAMEWORK-{fits,two,loop}/repI and
# mlx-fits-mpi/repI; `bench_plan.py --recompute KEEP/FRAMEWORK-two --repeat K --fit-on KEEP/FRAMEWORK-fits ...`
# prints them again with the model as it stands, as the end of this script does.
# Environment: FRAMEWORKS (torch mlx), MESHES, LINKS (two loop: the two-level link, loopback), FIT_STRATEGIES
# (ddp,fsdp,tp,pp: the N=2 runs the axes are fitted on; a mesh needs those of its axes, dp's from ddp), PY (the
# checkout's .venv python, else python3). One row on a lent machine's few minutes:
#   MESHES=dp=2,tp=2 LINKS=two FIT_STRATEGIES=ddp,tp FRAMEWORKS=mlx bash benchmarks/mesh_plan_sittings.sh KEEP 4
# Two levels need
# root and `ip` (compare/launch/topology.py); without them only the loopback rows are made.
set -u
die() { echo "mesh_plan_sittings.sh: $*" >&2; exit 2; }
[ $# -ge 1 ] && [ $# -le 2 ] || die "usage: bash benchmarks/mesh_plan_sittings.sh KEEP [K]"
KEEP=$1; K=${2:-3}
[[ $K =~ ^[1-9][0-9]*$ ]] || die "K=$K: needs a whole number of sittings, 1 or more"
[ -e "$KEEP" ] && [ -n "$(ls -A "$KEEP" 2>/dev/null)" ] && die "$KEEP holds earlier sittings: name a new folder"
KEEP=$(mkdir -p "$KEEP/out" && cd "$KEEP" && pwd) || die "$1: cannot make that folder"
cd "$(dirname "$0")/.." || exit 2
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1  # MLX's meshes run on MPI
MESHES=${MESHES:-"dp=2,pp=2;dp=2,tp=2;fsdp=2,tp=2"}
SHAPE=(--device cpu --no-wait --preset tiny --set model.n_layers=4 --set model.n_kv_heads=4 --seq-len 128
       --batch 16 --steps 10)
read -ra LINKS <<< "${LINKS:-two loop}"
for link in "${LINKS[@]}"; do [[ $link == two || $link == loop ]] || die "LINKS=$LINKS: each is two or loop"; done
if [ "$(id -u)" = 0 ] && command -v ip >/dev/null; then :; else
    LINKS=(loop)
    echo "no root or no ip: the meshes on loopback only"; fi
link_args() { [ "$1" = two ] && echo "--links 100mbit/1gbit --group-size 2" || echo "--links none"; }
bench() { "$PY" benchmarks/bench_plan.py "$@"; }
fit_sets() { echo "$1-fits"; [ "$1" = mlx ] && echo mlx-fits-mpi; }
lscpu | grep -E '^Model name|^CPU\(s\)'; grep -q -m1 avx512f /proc/cpuinfo && echo avx512f || echo "no avx512f"
for ((i = 0; i < K; i++)); do
    for fw in ${FRAMEWORKS:-torch mlx}; do
        echo "== sitting $i, $fw: N=1,2 on loopback ($(date +%T), load $(cut -d' ' -f1 /proc/loadavg))"
        for fits in $(fit_sets "$fw"); do  # MLX's meshes run on MPI, its one-axis runs on ring: fits on both
            bench --frameworks "$fw" --links none --strategies "${FIT_STRATEGIES:-ddp,fsdp,tp,pp}" --nproc 2 "${SHAPE[@]}" \
                $( [ "$fits" = mlx-fits-mpi ] && echo --set backend=mpi ) --keep "$KEEP/$fits/rep$i" \
                --out "$KEEP/out/$fits-$i.json" > "$KEEP/out/$fits-$i.log" 2>&1 \
                || { tail -n 3 "$KEEP/out/$fits-$i.log"; exit 1; }
        done
        for link in "${LINKS[@]}"; do
            echo "== sitting $i, $fw: the meshes, $link ($(date +%T), load $(cut -d' ' -f1 /proc/loadavg))"
            # shellcheck disable=SC2046 # link_args is two words on purpose
            bench --frameworks "$fw" $(link_args "$link") --strategies '' --meshes "$MESHES" --nproc 4 --fit \
                --fit-on "$KEEP/$fw-fits/rep$i" "${SHAPE[@]}" --keep "$KEEP/$fw-$link/rep$i" \
                --out "$KEEP/out/$fw-$link-$i.json" > "$KEEP/out/$fw-$link-$i.log" 2>&1 \
                || { tail -n 3 "$KEEP/out/$fw-$link-$i.log"; exit 1; }
            grep -E -- "-n4 " "$KEEP/out/$fw-$link-$i.log"
        done
    done
done
[ "$K" -gt 1 ] || exit 0
echo "== each mesh over the $K sittings, with the model as it stands"
for fw in ${FRAMEWORKS:-torch mlx}; do
    for fits in $(fit_sets "$fw"); do
        for link in "${LINKS[@]}"; do
            echo "-- $fw, $link, fitted on $fits"
            # shellcheck disable=SC2046
            bench --frameworks "$fw" $(link_args "$link") --strategies '' --meshes "$MESHES" --nproc 4 --fit \
                --fit-on "$KEEP/$fits" "${SHAPE[@]}" --recompute "$KEEP/$fw-$link" --repeat "$K" \
                --out "$KEEP/out/$fw-$link-$fits-medians.json" | sed -n '/over the/,$p' | grep -vE '^(wrote|each layout)|^$'
        done
    done
done
