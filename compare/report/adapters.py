"""The report's fine-tuning table, where a comparison holds a LoRA run (common/model/lora.py): for each run, what
trains, how many parameters that is, the bytes its step all-reduces (counted, and the estimate), the frozen base
each rank holds, beside tokens/s and the peak RSS, so that full and LoRA runs of one compare read side by side.
"""
from __future__ import annotations

from .findings import MB


def adapter_blocks(rows: list[dict]) -> list[tuple]:
    if not any(r.get("adapters") for r in rows):
        return []
    headers = ("run", "trains", "loss normalization", "trained parameters", "all-reduced per step (estimate)",
               "frozen base MB/rank", "tokens/s", "peak RSS MB/rank")
    return [("h2", "What trains"),
            ("p", "LoRA runs train adapters beside a frozen base: only the adapters have gradients and AdamW state, and "
                  "only they are all-reduced (docs/finetuning.md). Parameters are float32, 4 bytes each; a quantized "
                  "base (QLoRA) holds its packed words, scales and biases, the bytes each framework's ranks read."),
            ("table", headers, [adapter_cells(r) for r in rows])]


def adapter_cells(r: dict) -> tuple:
    a = r.get("adapters")
    trained_mb = first((r.get("state_mb") or {}).get("params"))
    trained = f"{trained_mb * MB / 4:,.0f}" if trained_mb is not None else "–"
    read_mb = first(r.get("weights_mb_read"))
    base = f"{read_mb - trained_mb:,.1f}" if a and read_mb is not None and trained_mb is not None else "–"
    comm, estimate = r.get("comm_bytes_per_step"), r.get("comm_bytes_per_step_estimate")
    wire = "–" if comm is None else f"{comm:,} B" + ("" if estimate is None else f" ({estimate:,})")
    what = (f"LoRA r={a['rank']} alpha={a['alpha']:g} on {','.join(a['targets'])}"
            + (f", last {a['layers']} blocks" if a.get("layers") else "")) if a else "every parameter"
    if q := r.get("base_quantization"):  # QLoRA: the base's storage beside its bytes
        what += f"; {q['bits']}-bit base, groups of {q['group_size']}"
    rss = [m for m in r.get("peak_rss_mb") or [] if m is not None]
    return (r["label"], what, r.get("loss_normalization") or "global-tokens", trained, wire, base,
            "–" if r.get("tokens_per_s") is None else f"{r['tokens_per_s']:,.0f}",
            " / ".join(f"{m:,.0f}" for m in rss) or "–")


def first(values) -> float | None:
    return next((v for v in values or [] if v is not None), None)
