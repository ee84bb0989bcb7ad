#!/bin/bash
# Issue 37's table: the meshes at N=4 on `base`, on loopback and over the two-level link, with the cost model's
# prediction of each beside what it measured:
#
#   bash benchmarks/mesh_table.sh OUT        (about 25 minutes on 2 cores: the two-level data-parallel rows are
#                                            link-bound, 0.5-1.5 min a step)
#
# base has 3 kv heads, which no tp=2 splits, so the table's model has 4 (--set model.n_kv_heads=4): 1.1 % more
# parameters. Per framework: ddp at N=1 (what the model is calibrated on, with its time breakdown), ddp, fsdp, tp
# and pp at N=2 on loopback (the axes' fits; MLX's on MPI, which its meshes need, and tp on ring too, which its
# one-axis tp x4 runs on); then at N=4 ddp, tp, pp and the meshes dp2 x pp2, dp2 x tp2 and fsdp2 x tp2 on loopback,
# and all but ddp over 100mbit between groups of two ranks on 1gbit (ddp x4 and fsdp x4 over it: docs/strategies.md's
# first table). Checkpoints are sharded and deleted after each run (a base run's are 1.2 GB).
# It ends with benchmarks/predict_runs.py's table. Environment: FRAMEWORKS (torch mlx), PY (the checkout's .venv
# python, else python3). Two levels need root and `ip`; without them the loopback rows only.
set -u
die() { echo "mesh_table.sh: $*" >&2; exit 2; }
[ $# -eq 1 ] || die "usage: bash benchmarks/mesh_table.sh OUT"
[ -e "$1" ] && [ -n "$(ls -A "$1" 2>/dev/null)" ] && die "$1 holds runs already: name a new folder"
OUT=$(mkdir -p "$1/ring" && cd "$1" && pwd) || die "$1: cannot make that folder"
cd "$(dirname "$0")/.." || exit 2
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
DPC=("$PY" -m compare.cli)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1  # MLX's meshes run on MPI
SHAPE=(--preset base --set model.n_kv_heads=4 --seq-len 64 --global-batch-size 8 --set timing_warmup_steps=1
       --warmup-steps 1 --eval-every 0 --no-op-profile --quiet --collective-timeout-s 900 --checkpoint-every 0
       --threads-per-rank 1 --checkpoint-format sharded)
TWO=(--link 100mbit --link-inner 1gbit --group-size 2)
LINKS=(loop)
if [ "$(id -u)" = 0 ] && command -v ip >/dev/null; then LINKS=(loop two); else
    echo "no root or no ip: the loopback rows only"; fi
lscpu | grep -E '^Model name|^CPU\(s\)'; grep -q -m1 avx512f /proc/cpuinfo && echo avx512f || echo "no avx512f"
run() {  # NAME FLAGS...: one dpcompare run into OUT/NAME, its time and the load, its checkpoints deleted
    local name=$1 start; shift; start=$(date +%s)
    timeout 1200 "${DPC[@]}" run "${SHAPE[@]}" --out "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
    echo "$name: exit $?, $(( $(date +%s) - start )) s, load $(cut -d' ' -f1 /proc/loadavg)"
    rm -rf "$OUT/$name/checkpoints"
}
for fw in ${FRAMEWORKS:-torch mlx}; do
    B=(); [ "$fw" = mlx ] && B=(--backend mpi)
    run "$fw-n1" --framework "$fw" --nproc 1 --steps 4 --profile-steps 2
    run "$fw-n2" --framework "$fw" --nproc 2 --steps 4 --profile-steps 0 "${B[@]}"
    run "$fw-fsdp-n2" --framework "$fw" --strategy fsdp --nproc 2 --steps 4 --profile-steps 0 "${B[@]}"
    run "$fw-tp-n2" --framework "$fw" --strategy tp --nproc 2 --steps 4 --profile-steps 0 "${B[@]}"
    run "$fw-pp-n2" --framework "$fw" --strategy pp --pp-microbatches 2 --nproc 2 --steps 4 --profile-steps 0 "${B[@]}"
    [ "$fw" = mlx ] && cp -r "$OUT/mlx-n1" "$OUT/ring/" && \
        OUT=$OUT/ring run mlx-tp-n2 --framework mlx --strategy tp --nproc 2 --steps 4 --profile-steps 0 --backend ring
    for link in "${LINKS[@]}"; do
        L=(--steps 4); [ "$link" = two ] && L=(--steps 3 "${TWO[@]}")
        [ "$link" = loop ] && run "$fw-ddp4-$link" --framework "$fw" --nproc 4 "${B[@]}" "${L[@]}" --profile-steps 0
        run "$fw-tp4-$link" --framework "$fw" --strategy tp --nproc 4 "${L[@]}" --profile-steps 0
        run "$fw-pp4-$link" --framework "$fw" --strategy pp --pp-microbatches 4 --nproc 4 "${B[@]}" "${L[@]}" \
            --profile-steps 0
        run "$fw-dp2pp2-$link" --framework "$fw" --mesh dp=2,pp=2 --pp-microbatches 2 --nproc 4 "${L[@]}" \
            --profile-steps 0
        run "$fw-dp2tp2-$link" --framework "$fw" --mesh dp=2,tp=2 --nproc 4 "${L[@]}" --profile-steps 0
        run "$fw-fsdp2tp2-$link" --framework "$fw" --mesh fsdp=2,tp=2 --nproc 4 "${L[@]}" --profile-steps 0
    done
done
"$PY" benchmarks/predict_runs.py "$OUT"
