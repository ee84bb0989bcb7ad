#!/usr/bin/env bash
# A newcomer's first run, as issue 72 measures it: a fresh clone, empty caches, the README's two commands, then the
# demo at N=1 with MLX on each OpenBLAS this machine has, alternating, to compare the MLX/torch ratios in one sitting.
#
#   bash benchmarks/fresh_machine.sh [WORK_DIR] [ROUNDS]
#
# The clone goes to WORK_DIR/clone (with ../shared linked beside it), its caches to WORK_DIR/cache and WORK_DIR/tmp,
# new folders, so MLX's kernels, the kernel choices and the BLAS links start cold. For "a machine with python3, make
# and git only", run it where no system OpenBLAS or libgfortran is installed (`ldconfig -p | grep -c
# 'openblas\|gfortran'` prints 0); then `apt install libopenblas0-pthread` and run it again with ROUNDS=2 to add
# `--mlx-blas system` beside `--mlx-blas wheel`. Prints one line per step and per demo.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
work="${1:-$(mktemp -d)}"
rounds="${2:-1}"
rm -rf "$work/clone" "$work/cache" "$work/tmp" "$work/runs"
mkdir -p "$work/tmp" "$work/runs" && chmod 700 "$work/tmp"
git clone -q "$here" "$work/clone"
[ -e "$work/shared" ] || ln -s "$(cd "$here/../shared" 2>/dev/null && pwd || echo /nonexistent)" "$work/shared"
export DPCOMPARE_CACHE="$work/cache" TMPDIR="$work/tmp"
cd "$work/clone"
echo "machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores, $(grep -q avx512f /proc/cpuinfo && echo AVX-512 || echo no AVX-512); system BLAS/Fortran libraries: $(ldconfig -p | grep -c 'openblas\|gfortran' || true)"
start=$(date +%s); make install >"$work/install.log" 2>&1; end=$(date +%s)
echo "make install: $((end - start)) s"
start=$(date +%s); make demo OUT="$work/runs/demo" >"$work/demo.log" 2>&1; end=$(date +%s)
echo "make demo (cold caches): $((end - start)) s"
ratio() {  # the MLX/torch tokens/s of a comparison's N=1 runs
  python3 -c "import json,sys; m,t=(json.load(open(f'{sys.argv[1]}/{f}-n1/summary.json')) for f in ('mlx','torch'));
print(f\"mlx {m['tokens_per_s']:,.0f} torch {t['tokens_per_s']:,.0f} tokens/s, ratio {m['tokens_per_s']/t['tokens_per_s']:.3f};\", m['blas'].split(';')[0])" "$1"
}
echo "demo: $(ratio "$work/runs/demo")"
blas="wheel"; ldconfig -p | grep -q libopenblas.so.0 && blas="wheel system"
for round in $(seq "$rounds"); do
  for b in $blas; do
    .venv/bin/dpcompare compare --config demo --frameworks mlx,torch --nproc 1 --mlx-blas "$b" --no-samples \
      --out "$work/runs/$b-$round" --overwrite >"$work/runs/$b-$round.log" 2>&1
    echo "round $round, --mlx-blas $b: $(ratio "$work/runs/$b-$round")"
  done
done
