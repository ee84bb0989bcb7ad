#!/bin/bash
# Issue 37's plan check (N=4 predicted from N=1, each axis fitted on its strategy's N=2 run) on a machine with a
# core per rank: the lent GPU machine's 16 CPU cores (docs/scaling.md, "Sitting 5"). That machine has torch but no
# mlx and reaches no registry, so MLX for CPU is downloaded here for its Python and carried:
#
#   bash benchmarks/lent_machine_plan.sh prepare 3.12    # here: mlx + mlx-cpu wheels unpacked into .devcheck/
#   # then through the device tool, with carry [".devcheck"]:
#   bash benchmarks/lent_machine_plan.sh run              # torch, then MLX (meshes on MPI where mpirun exists)
#
# `run` writes plan_torch.json, plan_mlx.json, their logs and the kept runs (no checkpoints) under $OUT (default
# runs/lent), prints both tables, and stops each framework before its share of ~9 minutes is spent. Extra
# bench_plan flags go after `run` (for example `--set backend=mpi`, sitting 5c). Unpack kept_runs.tgz here and
# `bench_plan.py --recompute /tmp/lent_torch ...` (the same flags) prints the tables again with the model as it stands.
set -u
cd "$(dirname "$0")/.."
case "${1:-}" in
prepare)
    ver=${2:-3.12}; mlx=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('mlx'))")
    site=.devcheck/site${ver/./}; tmp=$(mktemp -d)
    .venv/bin/python -m pip download "mlx==$mlx" "mlx-cpu==$mlx" --no-deps --only-binary :all: -q \
        --python-version "$ver" --platform manylinux_2_35_x86_64 -d "$tmp" || exit 2
    rm -rf "$site" && mkdir -p "$site" && for w in "$tmp"/*.whl; do .venv/bin/python -m zipfile -e "$w" "$site"; done
    rm -rf "$tmp"; du -sh "$site"; exit 0 ;;
run) shift ;;
*) echo "usage: $0 prepare [PYTHON_VERSION] | run [bench_plan flags]" >&2; exit 2 ;;
esac
exec 2>&1
PY=$(command -v python3 || command -v python); OUT=${OUT:-runs/lent}; mkdir -p "$OUT"; START=$SECONDS
rm -rf /tmp/lent_torch /tmp/lent_mlx  # bench_plan --keep refuses a folder that holds an earlier sitting
until_s() { echo $(( $1 - (SECONDS - START) )); }
lscpu | grep -E '^Model name|^CPU\(s\)'; grep -q -m1 avx512f /proc/cpuinfo && echo avx512f || echo "no avx512f"
site=$PWD/.devcheck/site$($PY -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
export PYTHONPATH=$site OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
$PY -c "import torch; print('torch', torch.__version__)"; uptime
SHAPE=(--device cpu --no-wait --preset tiny --nproc 4 --links none --strategies ddp,fsdp,tp,pp --fit
       --meshes "dp=2,pp=2;dp=2,tp=2;fsdp=2,tp=2;pp=2,tp=2" --set model.n_layers=4 --set model.n_kv_heads=4
       --seq-len 128 --batch 16 --steps 12 "$@")
echo "== torch ($(date +%T))"
timeout "$(until_s 330)" $PY benchmarks/bench_plan.py --frameworks torch "${SHAPE[@]}" --keep /tmp/lent_torch \
    --out "$OUT/plan_torch.json" > "$OUT/torch.log"; echo "exit $?"; tail -n 12 "$OUT/torch.log"
if $PY -c "import mlx.core" 2>/dev/null; then
    echo "== mlx ($(date +%T)); its meshes need mpirun: $(command -v mpirun || echo missing)"
    timeout "$(until_s 540)" $PY benchmarks/bench_plan.py --frameworks mlx "${SHAPE[@]}" --keep /tmp/lent_mlx \
        --out "$OUT/plan_mlx.json" > "$OUT/mlx.log"; echo "exit $?"; tail -n 12 "$OUT/mlx.log"
else
    echo "== mlx: not importable from $site (run 'prepare' for this Python: $($PY -V))"
fi
(cd /tmp && tar czf - --exclude=checkpoints lent_torch lent_mlx 2>/dev/null) > "$OUT/kept_runs.tgz"; uptime
