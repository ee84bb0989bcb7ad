#!/bin/bash
# Issue 37's plan check (N=4 predicted from N=1, each axis fitted on its strategy's N=2 run) on a machine with a
# core per rank: the lent GPU machine's 16 CPU cores (docs/scaling.md, "Sitting 5" and "Sitting 7"). That machine
# has torch but no mlx and no iproute2, and reaches no registry, so MLX for CPU is downloaded here for its Python,
# and this machine's `ip` and `tc` are copied with their libraries (not glibc: theirs is newer), and both carried:
#
#   bash benchmarks/lent_machine_plan.sh prepare 3.12    # here: mlx wheels and iproute2 into .devcheck/
#   # then through the device tool, with carry [".devcheck"]:
#   bash benchmarks/lent_machine_plan.sh run              # sitting 5: loopback, one-axis strategies and meshes
#   bash benchmarks/lent_machine_plan.sh two-level        # sitting 7: fits on loopback, meshes over 100mbit/1gbit
#   FRAMEWORKS=mlx bash benchmarks/lent_machine_plan.sh sittings 2   # mesh_plan_sittings.sh, K sittings
#   # its environment (MESHES, LINKS, FIT_STRATEGIES) narrows them: one mesh over two levels, ~4 sittings;
#   # SIT_LIMIT (seconds, 540) stops them sooner, so two such calls fit in one device command
#   MESHES=dp=2,tp=2 LINKS=two FIT_STRATEGIES=ddp,tp FRAMEWORKS=mlx bash benchmarks/lent_machine_plan.sh sittings 4
#
# `run` writes plan_torch.json, plan_mlx.json, their logs and the kept runs (no checkpoints) under $OUT (default
# runs/lent), prints both tables, and stops each framework before its share of ~9 minutes is spent. Extra
# bench_plan flags go after `run` (for example `--set backend=mpi`, sitting 5c). Unpack kept_runs.tgz here and
# `bench_plan.py --recompute /tmp/lent_torch ...` (the same flags) prints the tables again with the model as it stands.
# `two-level` trains, per framework, the N=1 and N=2 runs on loopback, then the three meshes of issue 37 over
# 100mbit between groups of two on 1gbit fitted on them (`--fit-on`), then the meshes on loopback while time is
# left, and returns one kept7.tgz (the device returns 8 files at most). `sittings K` runs
# benchmarks/mesh_plan_sittings.sh (its flow, MLX fitted on ring and MPI, the medians at the end) within ~9 minutes
# and returns sittings.tgz: an MLX sitting took ~4 minutes there in sitting 7's terms, torch ~6.
set -u
cd "$(dirname "$0")/.."
case "${1:-}" in
prepare)
    ver=${2:-3.12}; mlx=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('mlx'))")
    site=.devcheck/site${ver/./}; tmp=$(mktemp -d)
    .venv/bin/python -m pip download "mlx==$mlx" "mlx-cpu==$mlx" --no-deps --only-binary :all: -q \
        --python-version "$ver" --platform manylinux_2_35_x86_64 -d "$tmp" || exit 2
    rm -rf "$site" && mkdir -p "$site" && for w in "$tmp"/*.whl; do .venv/bin/python -m zipfile -e "$w" "$site"; done
    rm -rf "$tmp"; du -sh "$site"
    net=.devcheck/net; rm -rf "$net" && mkdir -p "$net/bin" "$net/lib" || exit 2
    for t in ip tc; do
        cp "$(command -v $t)" "$net/$t.bin" || exit 2
        ldd "$net/$t.bin" | awk '/=> \//{print $3}' | grep -Ev '/(libc|libm|ld-linux[^/]*)\.so' | xargs -r cp -Lt "$net/lib"
        # run by the lent machine's own loader and glibc, with these libraries: carrying this machine's glibc broke
        # MLX's ranks there, whose LD_PRELOAD (its BLAS) needs the newer glibc in every process `ip netns exec` starts
        printf '#!/bin/sh\nd=$(cd "$(dirname "$0")/.." && pwd)\nexec /lib64/ld-linux-x86-64.so.2 --library-path "$d/lib" "$d/%s.bin" "$@"\n' \
            $t > "$net/bin/$t"; chmod +x "$net/bin/$t"
    done; du -sh "$net"; exit 0 ;;
run|two-level|sittings) mode=$1; shift ;;
*) echo "usage: $0 prepare [PYTHON_VERSION] | run [bench_plan flags] | two-level | sittings [K]" >&2; exit 2 ;;
esac
exec 2>&1
PY=${PY:-$(command -v python3 || command -v python)}; OUT=${OUT:-runs/lent}; mkdir -p "$OUT"; START=$SECONDS
rm -rf /tmp/lent_torch /tmp/lent_mlx  # bench_plan --keep refuses a folder that holds an earlier sitting
until_s() { echo $(( $1 - (SECONDS - START) )); }
lscpu | grep -E '^Model name|^CPU\(s\)'; grep -q -m1 avx512f /proc/cpuinfo && echo avx512f || echo "no avx512f"
site=$PWD/.devcheck/site$($PY -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
export PYTHONPATH=$site OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
$PY -c "import torch; print('torch', torch.__version__)"; uptime
command -v ip >/dev/null || export PATH=$PWD/.devcheck/net/bin:$PATH
if [ "$mode" = sittings ]; then
    rm -rf /tmp/sit; PY=$PY timeout "${SIT_LIMIT:-540}" bash benchmarks/mesh_plan_sittings.sh /tmp/sit "${1:-2}"; echo "exit $?"
    (cd /tmp && tar czf - --exclude=checkpoints --exclude='*.html' --exclude=plots sit) > "$OUT/sittings.tgz"; uptime
    exit 0
fi
if [ "$mode" = two-level ]; then
    K=/tmp/s7; rm -rf $K; mkdir -p $K/out
    SHAPE=(--device cpu --no-wait --preset tiny --set model.n_layers=4 --set model.n_kv_heads=4 --seq-len 128
           --batch 16 --steps 10)
    MESHES="dp=2,pp=2;dp=2,tp=2;fsdp=2,tp=2"; at=0
    for fw in torch mlx; do  # sitting 7: torch's fits took 68 s and its meshes 186 s; MLX's 28 s and 109 s
        at=$((at + 270)); echo "== $fw: N=1,2 on loopback, then the meshes over 100mbit/1gbit ($(date +%T))"
        timeout "$(until_s $((at - 170)))" $PY benchmarks/bench_plan.py --frameworks $fw --links none \
            --strategies ddp,fsdp,tp,pp --nproc 2 "${SHAPE[@]}" --keep $K/$fw-fits --out $K/out/$fw-fits.json \
            > $K/out/$fw-fits.log; echo "exit $?"
        timeout "$(until_s $at)" $PY benchmarks/bench_plan.py --frameworks $fw --links 100mbit/1gbit --group-size 2 \
            --strategies '' --meshes "$MESHES" --nproc 4 --fit --fit-on $K/$fw-fits "${SHAPE[@]}" --keep $K/$fw-two \
            --out $K/out/$fw-two.json > $K/out/$fw-two.log; echo "exit $?"; tail -n 6 $K/out/$fw-two.log
    done
    for fw in torch mlx; do
        [ "$(until_s 560)" -gt 100 ] || break
        echo "== $fw: the meshes on loopback ($(date +%T))"
        timeout "$(until_s 560)" $PY benchmarks/bench_plan.py --frameworks $fw --links none --strategies '' \
            --meshes "$MESHES" --nproc 4 --fit --fit-on $K/$fw-fits "${SHAPE[@]}" --keep $K/$fw-loop \
            --out $K/out/$fw-loop.json > $K/out/$fw-loop.log; echo "exit $?"; tail -n 6 $K/out/$fw-loop.log
    done
    (cd /tmp && tar czf - --exclude=checkpoints --exclude='*.html' --exclude=plots s7) > "$OUT/kept7.tgz"; uptime
    exit 0
fi
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
