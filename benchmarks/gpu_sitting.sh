#!/bin/bash
# The torch CUDA paths on a lent GPU machine (one NVIDIA H200 here), in one device command of about 4 minutes:
# docs/benchmarks.md, "GPU (gpu_sitting.sh)". That machine has python3 with torch (CUDA), tokenizers and
# transformers, but no mlx and no registry, so dpcompare runs from this checkout (PYTHONPATH) and MLX is left out.
# The GPT-2 tokenizer and the TinyStories sample travel in .devcheck/gpudata (ignored by git; ../shared does not):
#
#   mkdir -p .devcheck/gpudata && cp -r ../shared/data/gpt2 ../shared/data/tinystories .devcheck/gpudata/
#   # then through the device tool, with carry [".devcheck/gpudata"] and timeout_s about 420:
#   bash benchmarks/gpu_sitting.sh
#   # here, on the CPU, every step at toy shapes (about 4 minutes on 2 cores), before spending device time:
#   SMOKE=1 PY=.venv/bin/python OUT=/tmp/gpu_smoke bash benchmarks/gpu_sitting.sh
#
# In order, each piece under `timeout` and within BUDGET seconds in all (380): the machine (lscpu, nvidia-smi,
# torch); the matmul peaks (8192^3 bf16 and fp32 products timed here, and torch_impl.peak, the project's own fp32
# measurement); `dpcompare run --framework torch` at N=1 on cuda for tiny (builtin corpus) and small (TinyStories,
# GPT-2 tokenizer), fp32 and bf16, seq 128, global batch 8, STEPS steps; base at seq 1024 in bf16 for each of
# BASE_BATCHES; nccl at world size 1 (torch_impl.probe: `dpcompare run` at N=1 starts no process group, so the
# backend is reached only this way); `dpcompare report` over the cuda runs (its MFU: the datasheet peak of
# common/model/flops.py); the same tiny and small runs on the machine's CPU (every core to the one rank, fp32
# first) for the per-step loss comparison. The end prints one table and writes OUT (default runs/gpu_sitting):
# summary.json, sitting.log and gpu_sitting.tgz (the runs' logs, summaries and metrics, no checkpoints; the report).
# Environment: PY (python3), OUT, BUDGET, STEPS (40), BASE_STEPS (20), BASE_SEQ (1024), BASE_BATCHES ("16 32 64"),
# COMPILE_BATCHES (none: base again with `--set torch_compile=true` at these batches, after the eager ones), PARTS
# (peaks,small,base,compiled,probe,report,cpu: the pieces to run), CPU_THREADS (every core), GPU_DEV (cuda), DATA
# (.devcheck/gpudata, else ../shared/data), SMOKE=1 (GPU_DEV=cpu and toy shapes). The second sitting of
# docs/benchmarks.md (torch.compile, about 4 minutes):
#   PARTS=peaks,base,compiled,report BASE_BATCHES=64 COMPILE_BATCHES="32 64" bash benchmarks/gpu_sitting.sh
set -u
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
PY=${PY:-python3}
OUT=${OUT:-runs/gpu_sitting}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
W=${WORK:-/tmp/gpu_sitting}; rm -rf "$W"; mkdir -p "$W/runs" "$W/logs" "$W/cache"
DATA=${DATA:-$ROOT/.devcheck/gpudata}; [ -d "$DATA/gpt2" ] || DATA=$ROOT/../shared/data
DATA=$(cd "$DATA" && pwd) || { echo "no data folder (see the header)"; exit 2; }
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
START=$SECONDS
if [ "${SMOKE:-0}" = 1 ]; then
    GPU_DEV=${GPU_DEV:-cpu}; STEPS=${STEPS:-6}; BASE_STEPS=${BASE_STEPS:-5}; BASE_SEQ=${BASE_SEQ:-256}
    BASE_BATCHES=${BASE_BATCHES:-"2 4"}; BUDGET=${BUDGET:-300}
    SHRINK=(--set model.n_layers=1 --set model.dim=64 --set model.n_heads=4 --set model.n_kv_heads=1
            --set model.ffn_dim=128)
else
    GPU_DEV=${GPU_DEV:-cuda}; STEPS=${STEPS:-40}; BASE_STEPS=${BASE_STEPS:-20}; BASE_SEQ=${BASE_SEQ:-1024}
    BASE_BATCHES=${BASE_BATCHES:-"16 32 64"}; BUDGET=${BUDGET:-380}; SHRINK=()
fi
CPU_THREADS=${CPU_THREADS:-$(nproc)}; COMPILE_BATCHES=${COMPILE_BATCHES:-}
PARTS=${PARTS:-peaks,small,base,compiled,probe,report,cpu}
has() { [[ ",$PARTS," == *",$1,"* ]]; }
exec > >(tee "$OUT/sitting.log") 2>&1

# Seconds a piece may take: at most $1, and never into the 25 s kept for the summary and the archive.
limit() { local left=$((BUDGET - (SECONDS - START) - 25)); [ "$left" -lt "$1" ] && echo "$left" || echo "$1"; }
piece() {  # NAME MAX_S COMMAND...: run it under timeout, its output in logs/NAME.log, one line here
    local name=$1 t; t=$(limit "$2"); shift 2
    if [ "$t" -lt 10 ]; then echo "  $name: skipped, out of time"; echo "$name skipped" >> "$W/status"; return; fi
    local t0=$SECONDS
    timeout -k 10 "$t" "$@" > "$W/logs/$name.log" 2>&1; local rc=$?
    echo "$name $rc $((SECONDS - t0))" >> "$W/status"
    echo "  $name: exit $rc, $((SECONDS - t0)) s: $(grep -v '^\s*$' "$W/logs/$name.log" | tail -n 1 | cut -c1-150)"
}
run() {  # NAME MAX_S dpcompare-run flags...
    local name=$1 max=$2; shift 2
    piece "$name" "$max" "$PY" -m compare.cli run --framework torch --nproc 1 --out "$W/runs/$name" \
        --cache-dir "$W/cache" --quiet --no-op-profile "$@"
}
TINY=(--preset tiny --dataset builtin --tokenizer builtin --seq-len 128 --global-batch-size 8 --steps "$STEPS")
SMALL=(--preset small --dataset "$DATA/tinystories/train.txt" --tokenizer "$DATA/gpt2" --seq-len 128
       --global-batch-size 8 --steps "$STEPS" "${SHRINK[@]}")

echo "== machine ($(date -u +%FT%TZ))"
lscpu | grep -E '^Model name|^CPU\(s\)'
command -v nvidia-smi >/dev/null && timeout 30 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
timeout 60 "$PY" -c "import sys, torch; import importlib.util as u
print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda,
      'gpus', torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')
print('mlx importable:', u.find_spec('mlx') is not None)"

has peaks && echo "== matmul peaks on $GPU_DEV"
has peaks && piece peaks 60 "$PY" - "$GPU_DEV" "$W/peaks.json" <<'EOF'
import json, sys, time
import torch
dev, out = torch.device(sys.argv[1]), sys.argv[2]
cuda = dev.type == "cuda"
def rate(dtype, n, reps=10):  # mean of `reps` timed products after 3 warm-ups, as in the device notes' KINDS.md
    g = torch.Generator(device="cpu").manual_seed(0)
    a, b = (torch.randn(n, n, generator=g).to(dev, dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    if cuda:
        torch.cuda.synchronize(dev)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            a @ b
        end.record(); end.synchronize()
        s = start.elapsed_time(end) / 1e3 / reps
    else:
        t = time.perf_counter()
        for _ in range(reps):
            a @ b
        s = (time.perf_counter() - t) / reps
    return {"flops": 2 * n ** 3 / s, "n": n, "seconds": s}
n = 8192 if cuda else 512
peaks = {"device": str(dev), "name": torch.cuda.get_device_name(dev) if cuda else "cpu",
         "tf32_allowed": torch.backends.cuda.matmul.allow_tf32,
         "bfloat16": rate(torch.bfloat16, n), "float32": rate(torch.float32, n)}
json.dump(peaks, open(out, "w"), indent=1)
print(f"{peaks['name']}: bf16 {peaks['bfloat16']['flops'] / 1e12:.1f} TFLOP/s, "
      f"fp32 {peaks['float32']['flops'] / 1e12:.1f} TFLOP/s ({n}^3 products, TF32 allowed: {peaks['tf32_allowed']})")
EOF
has peaks && piece peak_project 60 "$PY" -m torch_impl.peak --device "$GPU_DEV"

has small && echo "== torch on $GPU_DEV, N=1, tiny and small, $STEPS steps"
has small && for dt in float32 bfloat16; do
    run "gpu-tiny-$dt" 90 --device "$GPU_DEV" --dtype "$dt" "${TINY[@]}"
    run "gpu-small-$dt" 120 --device "$GPU_DEV" --dtype "$dt" "${SMALL[@]}"
done

BASE=(--device "$GPU_DEV" --dtype bfloat16 --preset base --dataset "$DATA/tinystories/train.txt"
      --tokenizer "$DATA/gpt2" --seq-len "$BASE_SEQ" --steps "$BASE_STEPS" "${SHRINK[@]}")
has base && echo "== base, seq $BASE_SEQ, bfloat16 on $GPU_DEV, global batch $BASE_BATCHES"
has base && for b in $BASE_BATCHES; do run "gpu-base-bfloat16-b$b" 90 "${BASE[@]}" --global-batch-size "$b"; done
if has compiled && [ -n "$COMPILE_BATCHES" ]; then  # the first steps compile (excluded from the medians)
    echo "== base as above with torch.compile (--set torch_compile=true), global batch $COMPILE_BATCHES"
    for b in $COMPILE_BATCHES; do
        run "gpu-base-bfloat16-b$b-compiled" 180 "${BASE[@]}" --global-batch-size "$b" --set torch_compile=true
    done
fi

backend=nccl; [ "$GPU_DEV" = cpu ] && backend=gloo
has probe && echo "== $backend all-reduce at world size 1 (torch_impl.probe)"
has probe && RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29631 \
    piece "probe-$backend" 60 "$PY" -m torch_impl.probe --backend "$backend" --device "$GPU_DEV" \
    --sizes 4096,1048576,33554432,268435456 --max-calls 20 --out "$W/probe.json"

has report && echo "== dpcompare report over the $GPU_DEV runs (its MFU)"
gpu_runs=(); for d in "$W"/runs/gpu-*; do [ -f "$d/summary.json" ] && gpu_runs+=("$d"); done
has report && [ ${#gpu_runs[@]} -gt 0 ] && \
    piece report 60 "$PY" -m compare.cli report "${gpu_runs[@]}" --out "$W/report"

has cpu && echo "== the same tiny and small runs on the CPU ($CPU_THREADS threads; fp32 first: must agree)"
CPU=(--device cpu --threads-per-rank "$CPU_THREADS" --profile-steps 0)
has cpu && for dt in float32 bfloat16; do
    run "cpu-tiny-$dt" 60 "${CPU[@]}" --dtype "$dt" "${TINY[@]}"
    run "cpu-small-$dt" 90 "${CPU[@]}" --dtype "$dt" "${SMALL[@]}"
done

echo "== summary ($((SECONDS - START)) s so far)"
timeout 60 "$PY" - "$W" "$OUT/summary.json" <<'EOF'
import json, statistics, sys
from pathlib import Path
from common.model.flops import flops_per_token, known_peak_flops
from common.model.spec import ModelSpec
W, out = Path(sys.argv[1]), Path(sys.argv[2])
def load(p, default=None):
    try:
        return json.loads(Path(p).read_text())
    except (OSError, ValueError):
        return default
def losses(run):
    rows = [json.loads(line) for line in (W / "runs" / run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r and "step" in r}
peaks = load(W / "peaks.json", {})
report = {r["label"].split("(")[-1].rstrip(")"): r
          for r in (load(W / "report" / "summary.json", {}) or {}).get("runs", [])}
gpu_name = peaks.get("name", "")
status = {line.split()[0]: line.split()[1:] for line in (W / "status").read_text().splitlines()} \
    if (W / "status").exists() else {}
rows = []
for d in sorted((W / "runs").iterdir()):
    s, rc = load(d / "summary.json"), load(d / "run_config.json", {})
    row = {"run": d.name, "exit": status.get(d.name, ["?"])[0]}
    if not s or s.get("status") != "ok":
        log = (W / "logs" / f"{d.name}.log")
        text = log.read_text().strip() if log.exists() else ""
        row["error"] = text.splitlines()[-1][:200] if text else "no summary"
        rows.append(row); continue
    cfg = s["config"]
    tokens = s["tokens_per_s"]
    row.update(device=s["device"], preset=cfg["preset"], dtype=s["dtype"], batch=cfg["global_batch_size"],
               seq=cfg["seq_len"], steps=s["steps"], tokens_per_s=tokens, step_ms=s["step_time_s"] * 1e3,
               p10_p90=[s.get("tokens_per_s_p10"), s.get("tokens_per_s_p90")], final_loss=s["final_loss"],
               peak_mem_mb=(s.get("peak_mem_bytes") or [0])[0] / 2**20, wall_s=s.get("wall_s"),
               threads=s.get("threads_per_rank"), versions=s.get("versions"), compile_s=s.get("compile_s"),
               first_step_s=s.get("time_to_first_step_s"), torch_compile=cfg.get("torch_compile"))
    if rc.get("spec"):
        per_token = flops_per_token(ModelSpec.from_dict(rc["spec"]), cfg["seq_len"])
        achieved = tokens * per_token
        row.update(flops_per_token=per_token, achieved_tflops=achieved / 1e12)
        if row["device"].startswith("cuda"):
            key = "bfloat16" if s["dtype"] == "bfloat16" else "float32"
            if peaks.get(key):
                row["mfu_measured_peak"] = achieved / peaks[key]["flops"]
            sheet = known_peak_flops(gpu_name, s["dtype"])
            if sheet:
                row["mfu_datasheet"] = achieved / sheet[1]
                row["datasheet"] = f"{sheet[0]} {key} {sheet[1] / 1e12:g} TFLOP/s"
    r = report.get(d.name)
    if r:
        row.update(report_mfu=r.get("mfu"), report_peak=r.get("peak_source"))
    rows.append(row)
by = {r["run"]: r for r in rows}
for r in rows:  # the cpu twin of each gpu run: per-step |dloss|
    twin = "cpu-" + r["run"][4:]
    if r["run"].startswith("gpu-") and "final_loss" in r and "final_loss" in by.get(twin, {}):
        a, b = losses(r["run"]), losses(twin)
        common = sorted(set(a) & set(b))
        diffs = [abs(a[k] - b[k]) for k in common]
        r["vs_cpu"] = {"steps": len(common), "max_abs_dloss": max(diffs), "first_step_dloss": diffs[0],
                       "median_abs_dloss": statistics.median(diffs)}
probe = load(W / "probe.json")
if probe:
    probe = {"backend": probe["backend"], "world_size": probe["world_size"], "device": probe["device"],
             "median_s": {str(x["size_bytes"]): statistics.median(x["times_s"]) for x in probe["results"]}}
result = {"peaks": peaks, "runs": rows, "probe": probe, "status": status}
out.write_text(json.dumps(result, indent=1))
def f(v, spec):
    return "-" if v is None else format(v, spec)
print(f"{'run':33} {'dev':6} {'B x T':>9} {'tok/s':>10} {'step ms':>8} {'peak MB':>8} {'loss':>7} "
      f"{'MFU meas':>8} {'MFU sheet':>9} {'rep MFU':>7} {'max|dL| cpu':>11} {'1st s':>5}")
for r in rows:
    if "error" in r:
        print(f"{r['run']:33} exit {r['exit']}: {r['error']}"); continue
    print(f"{r['run']:33} {r['device'][:6]:6} {str(r['batch']) + 'x' + str(r['seq']):>9} {r['tokens_per_s']:>10,.0f} "
          f"{r['step_ms']:>8.1f} {r['peak_mem_mb']:>8,.0f} {r['final_loss']:>7.4f} "
          f"{f(r.get('mfu_measured_peak'), '.1%'):>8} {f(r.get('mfu_datasheet'), '.1%'):>9} "
          f"{f(r.get('report_mfu'), '.1%'):>7} {f(r.get('vs_cpu', {}).get('max_abs_dloss'), '.2e'):>11} "
          f"{f(r.get('first_step_s'), '.1f'):>5}")
if peaks.get("bfloat16"):
    print(f"peaks ({peaks['name']}): bf16 {peaks['bfloat16']['flops'] / 1e12:.1f}, fp32 "
          f"{peaks['float32']['flops'] / 1e12:.2f} TFLOP/s measured; datasheet: "
          f"{(known_peak_flops(gpu_name, 'bfloat16') or ('none', 0))[0]}")
if probe:
    print(f"{probe['backend']} all-reduce, world size 1, median s by size: "
          + ", ".join(f"{k} B {v * 1e6:.0f} us" for k, v in probe["median_s"].items()))
EOF
echo "summary exit $?"
(cd "$W" && tar czf "$OUT/gpu_sitting.tgz" --exclude=checkpoints --exclude=cache runs logs status \
    $(ls -d peaks.json probe.json report 2>/dev/null))
ls -la "$OUT"; echo "total $((SECONDS - START)) s"
