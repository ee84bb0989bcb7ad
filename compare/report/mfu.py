"""The MFU denominator of each run: a measured CPU matmul peak, or a GPU's datasheet peak."""
from __future__ import annotations

from common.errors import UserError
from common.model.flops import flops_formula, flops_per_token, known_peak_flops, mfu
from common.model.spec import ModelSpec

from .parity import RunData


class PeakFinder:
    """The MFU denominator of each run: a measured CPU matmul peak, or a GPU's datasheet peak."""

    def __init__(self, runs: list[RunData], context: dict):
        self.context = context
        self.cpu_peaks: dict[int, dict] = {}
        self.notes: list[str] = []
        self._accelerator = context.get("accelerator")
        self._looked_up = "accelerator" in context

    def accelerator(self, run: RunData) -> str | None:
        machine = run.summary.get("machine") or {}
        if machine.get("accelerator"):
            return machine["accelerator"]
        if not self._looked_up and self._same_host(run):
            from ..machine.peak import accelerator_name

            self._accelerator, self._looked_up = accelerator_name(), True
        return self._accelerator

    def _same_host(self, run: RunData) -> bool:
        from ..machine.peak import this_host

        return (run.summary.get("machine") or {}).get("host") in (None, this_host())

    def cpu_peak(self, run: RunData, threads: int) -> dict | None:
        if threads not in self.cpu_peaks:
            peaks = self.context.get("peaks")
            if peaks is None and self._same_host(run):
                from ..machine.peak import measured_peaks

                peaks = measured_peaks(threads=threads)
            self.cpu_peaks[threads] = peaks or {}
        usable = {fw: p for fw, p in self.cpu_peaks[threads].items() if (p.get("flops") or 0) > 0}
        if not usable:
            return None
        best = max(usable, key=lambda fw: usable[fw]["flops"])
        return {"framework": best, **usable[best]}

    def mfu_for(self, run: RunData, row: dict) -> dict:
        empty = {"flops_per_token": None, "peak_flops": None, "peak_source": None, "mfu": None}
        spec_dict, seq_len = run.run_config.get("spec"), row.get("seq_len")
        if not spec_dict or not seq_len:
            return {**empty, "peak_source": "no model spec in run_config.json"}
        try:
            per_token = flops_per_token(ModelSpec.from_dict(spec_dict), seq_len)
        except UserError as err:
            return {**empty, "peak_source": f"model spec unreadable: {err}"}
        peak, source = self.peak_for(run, row)
        if not row.get("tokens_per_s"):
            return {**empty, "flops_per_token": per_token, "peak_source": "no throughput measured"}
        value = mfu(row["tokens_per_s"], per_token, peak) if peak else None
        return {"flops_per_token": per_token, "peak_flops": peak, "peak_source": source, "mfu": value}

    def peak_for(self, run: RunData, row: dict) -> tuple[float | None, str]:
        device, n = row["device"].lower(), row["world_size"]
        platform = ((run.summary.get("machine") or {}).get("platform") or "").lower()
        if device.startswith(("cuda", "gpu", "mps")):
            name = self.accelerator(run)
            found = known_peak_flops(name, row["dtype"]) if name else None
            if not found:
                return None, f"GPU {name or '(name unknown)'} is not in the known-peak table"
            key, per_gpu = found
            apple = "mac" in platform or "darwin" in platform or device == "mps" or key.startswith("Apple")
            # Ranks on one Mac share its GPU; CUDA ranks each drive their own.
            gpus = n if not apple or run.config.get("hostfile") else 1
            return per_gpu * gpus, f"{key} {row['dtype']} datasheet peak {per_gpu / 1e12:g} TFLOPS x {gpus}"
        threads = int(row.get("threads_per_rank") or 1)
        peak = self.cpu_peak(run, threads)
        if peak is None:
            return None, "no measured CPU peak (runs from another machine, or the measurement failed)"
        cpus = int((run.summary.get("machine") or {}).get("cpus") or n * threads)
        # Oversubscribed ranks share cores: the machine cannot exceed its cores' worth of peak.
        share = min(1.0, cpus / (n * threads))
        total = peak["flops"] * n * share
        shared = f" x {share:.2f} ({n * threads} threads on {cpus} CPUs)" if share < 1 else ""
        return total, (f"measured fp32 matmul rate {peak['flops'] / 1e9:.1f} GFLOP/s per rank at {threads} "
                       f"thread(s) ({peak['framework']}, the faster of the two) x {n} rank(s){shared}")

    def describe(self, runs: list[RunData]) -> dict:
        spec = next((r.run_config["spec"] for r in runs if r.run_config.get("spec")), None)
        seq_len = next((r.config.get("seq_len") for r in runs if r.config.get("seq_len")), None)
        return {
            "formula": _formula(spec, seq_len),
            "definition": "MFU = tokens/s x FLOPs per token / peak FLOP/s of all the hardware the run used",
            "cpu_peaks_by_threads": {str(t): p for t, p in self.cpu_peaks.items()},
            "accelerator": self._accelerator,
        }


def _formula(spec: dict | None, seq_len: int | None) -> str | None:
    try:
        return flops_formula(ModelSpec.from_dict(spec), seq_len) if spec and seq_len else None
    except UserError:
        return None
