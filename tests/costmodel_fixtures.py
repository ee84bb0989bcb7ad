"""summary.json dicts for the cost model's tests: the figures of a real 2-rank `compare` run (tiny preset,
builtin tokenizer of 512 tokens, seq_len 128, global batch 32, 8 profile steps; AMD EPYC, 2 cores, one
thread per rank), cut down to the fields the model reads, and the `link` record the emulated-link runs
add (its schema: issue 24's contract between the link and the plan halves)."""
from __future__ import annotations

import copy
import json
from pathlib import Path

SPEC = {"vocab_size": 512, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 176,
        "max_seq_len": 512, "rope_theta": 10000.0, "norm_eps": 1e-05, "tie_embeddings": False}
CONFIG = {"preset": "tiny", "model": {}, "seq_len": 128, "global_batch_size": 32, "grad_accum": 1,
          "all_reduce_size_mb": 32.0, "bucket_cap_mb": 25.0, "steps": 8}

_RUNS = {
    ("mlx", 1): dict(backend="none", step=0.12209439700001212, tps=33547.81300897529,
                     bd=(0.00023568650000527214, 0.08316554999998971, 0.041152658500010375, 0.0,
                         0.0017468654999959199, 0.00010008499999969445, 0.12715534049999633, None),
                     rss=[227610624], mem=[144158596], opt=1264140, comm=0),
    ("mlx", 2): dict(backend="ring", step=0.07416647800002352, tps=55227.1067799485,
                     bd=(0.0002073694999893405, 0.04285304500000109, 0.021608964500003935, 0.003750265999997282,
                         0.00252842649999252, 0.00017809700000270823, 0.072786297499988, 0.06903603149999071),
                     rss=[187211776, 187293696], mem=[73060272, 73063344], opt=1264140, comm=632064),
    ("torch", 1): dict(backend="none", step=0.0678626060000056, tps=60357.24593304982,
                       bd=(0.00029070350001347833, 0.020647382999996466, 0.04325080350001542, 0.0,
                           0.0013215964999773178, 0.0013497100000137152, 0.06352349949999336, None),
                       rss=[520486912], mem=[520486912], opt=1264212, comm=0),
    ("torch", 2): dict(backend="gloo", step=0.03971586599999455, tps=103132.58686089238,
                       bd=(0.0002205689999925653, 0.01159601999999893, 0.021333267999992245, 0.006233519999994996,
                           0.001373778500010303, 0.00032670349999364134, 0.043495360500003244,
                           0.03726184050000825),
                       rss=[473948160, 473047040], mem=[473948160, 473047040], opt=1264212, comm=632064),
}


def summary(framework: str, n: int, strategy: str = "ddp", link: dict | None = None) -> dict:
    r = _RUNS[(framework, n)]
    data, fwd, bwd, comm, opt, other, synced, unsynced = r["bd"]
    out = {
        "framework": framework, "world_size": n, "backend": r["backend"], "device": "cpu", "status": "ok",
        "strategy": strategy, "dtype": "float32", "steps": 8, "tokens_per_s": r["tps"], "step_time_s": r["step"],
        "tokens_per_step": 4096,
        "breakdown": {"data": data, "forward": fwd, "backward": bwd, "communication": comm, "optimizer": opt,
                      "other": other, "step_s": r["step"], "reference_step_s": synced, "synced_step_s": synced,
                      "unsynced_step_s": unsynced},
        "peak_rss_bytes": list(r["rss"]), "peak_mem_bytes": list(r["mem"]),
        "state_bytes": {"params": [632064] * n, "grads": [632064] * n, "optimizer": [r["opt"]] * n},
        "comm_bytes_per_step": r["comm"], "comm_bytes_per_step_estimate": r["comm"],
        "reduce_scatter": None,
        "config": {**CONFIG, "framework": framework, "nproc": n, "strategy": strategy, "dtype": "float32"},
    }
    if link is not None:
        out["link"] = link
    return copy.deepcopy(out)


def link_record(requested: str | None = "1gbit", latency_s: float = 200e-6, bandwidth_Bps: float = 110e6,
                backend: str = "gloo") -> dict:
    rate = {"1gbit": 1e9, "200mbit": 2e8, None: None}.get(requested)
    return {"requested": requested, "rate_bps": rate, "emulated": requested is not None,
            "tcp_bandwidth_Bps": 0.96 * rate / 8 if rate else None, "tcp_latency_s": 60e-6,
            "allreduce": {"backend": backend, "world_size": 2, "latency_s": latency_s, "bandwidth_Bps": bandwidth_Bps},
            "note": "test fixture"}


def write_run(run_dir: Path, summary_dict: dict, spec: dict = SPEC) -> Path:
    """A run directory as the runner leaves it, as far as the cost model reads it."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "summary.json").write_text(json.dumps(summary_dict))
    (run_dir / "run_config.json").write_text(json.dumps({"config": summary_dict["config"], "spec": spec,
                                                         "world_size": summary_dict["world_size"]}))
    return run_dir
