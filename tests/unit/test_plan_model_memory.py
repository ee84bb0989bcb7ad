"""The memory `dpcompare plan --model` predicts by phase (issue 56): fsdp's head and the op profile of a one-rank run,
each as the runs on the Zen 5 and the Intel VM measured it (docs/plan-model.md)."""
import math

import pytest

from common.costmodel.model_memory import model_memory
from common.costmodel.workload import Workload
from common.model.lora import Adapters, FullModel
from common.model.spec import PRESETS
from common.parallel import layout


def test_under_fsdp_the_heads_phase_holds_the_reductions_copies_of_an_untied_head_matrix():
    """fsdp's head phase holds, beyond the whole head matrix and its gradient (gathered_bytes), the reduction's copies
    of that gradient: torch's flat reduce-scatter input and the shard (1.5 matrices), MLX's fitted 3 (issue 56: small
    fsdp x2 was 14-20 % short of its peak RSS without them). Not at one rank, not in the summed backward phase, and
    not for a tied matrix, reduced with the embedding's part after the whole backward."""
    from dataclasses import replace

    from common.costmodel.model_memory import peak_phase
    from common.parallel.fsdp import FSDP_HEAD_MATRICES

    spec = PRESETS["small"].with_(vocab_size=50257)
    matrix = 50258 * spec.dim * 4  # padded to a multiple of the 2 ranks
    fsdp = layout("fsdp", 2)
    for framework in ("mlx", "torch"):
        w = Workload(spec, 128, 8, framework=framework, head_held=(3.0, 0.0))
        assert fsdp.head_gathered_bytes(w) == pytest.approx(FSDP_HEAD_MATRICES[framework] * matrix)
        phase, head = peak_phase(fsdp, w, FullModel(), None, 1e8)
        assert phase == "head" and head["gathered"] == pytest.approx(fsdp.gathered_bytes(w) + fsdp.head_gathered_bytes(w))
        without = peak_phase(fsdp, replace(w, head_held=None), FullModel(), None, 1e8)[1]
        assert without["gathered"] == fsdp.gathered_bytes(w)  # the summed phase: as memory.py's factors were fitted
        tied = replace(w, spec=spec.with_(tie_embeddings=True))
        assert fsdp.head_gathered_bytes(tied) == 0 and layout("ddp", 2).head_gathered_bytes(w) == 0
    assert FSDP_HEAD_MATRICES["torch"] == 1.5


def test_a_one_rank_rows_fit_counts_the_op_profiles_copy_of_the_gradients_and_names_no_op_profile(monkeypatch):
    """A run of one rank times its op classes after training with a constant gradient of every trained parameter
    beside the model (torch's 1B full fine-tune was killed there at 24.9 GB after training at 21): a row whose step
    fits but whose profile does not is NO, and the cheapest change is --no-op-profile. Nothing at N=2; run warns."""
    from common.config import RunConfig
    from common.costmodel.model_memory import op_profile_bytes
    from compare.plan import model
    from compare.plan.model_plan import cheapest_change, judge

    spec = PRESETS["base"].with_(vocab_size=50257)
    w = Workload(spec, 128, 8, framework="torch", head_held=(3.0, 0.0))
    grads = FullModel().trained_parameters(spec) * 4
    assert op_profile_bytes(layout("ddp", 1), w) == grads and op_profile_bytes(layout("ddp", 2), w) == 0
    assert op_profile_bytes(layout("ddp", 1), w, Adapters(8, 16.0)) < grads / 50  # LoRA: the adapters' alone
    row = {"strategy": "ddp", "world_size": 1, "mesh": ""}
    judge(row, w, FullModel(), None, 3e8, None)
    step = row["memory_bytes"]["total"]
    limit = step + grads / 2
    judge(row, w, FullModel(), None, 3e8, limit)
    assert row["fits"] is False and "op classes" in row["bottleneck"]
    assert cheapest_change(row, [row], w, FullModel(), None, 3e8, limit).startswith("--no-op-profile")
    judge(row, w, FullModel(), None, 3e8, step + grads * 1.2)
    assert row["fits"] and row["tight"]  # under 10 % to spare once the profile is counted
    cfg = RunConfig.from_dict({"preset": "base", "nproc": 1, "seq_len": 128, "global_batch_size": 8})
    w_run = Workload(cfg.model_spec(50257), 128, 8, framework=cfg.framework, head_held=(4.1, 0.0))
    peak = model_memory(cfg.layout, w_run)["total"]
    monkeypatch.setattr("common.costmodel.model_memory.machine_memory_bytes", lambda: peak + grads / 2)
    assert "op profile" in model.memory_warning(cfg, cfg.model_spec(50257))
    quiet = RunConfig.from_dict({"preset": "base", "nproc": 1, "seq_len": 128, "global_batch_size": 8,
                                 "op_profile": False})
    assert model.memory_warning(quiet, quiet.model_spec(50257)) is None


def test_torchs_gradients_under_the_heaps_threshold_reuse_the_activations_pages_and_its_update_holds_three_copies():
    """glibc's heap keeps the pages freed activations leave, and torch writes its gradients under 32 MB into them;
    a larger gradient is a mapping of its own on top (torch `base` ddp was 8-11 % over with every gradient summed,
    the 1B shape's full fine-tune 6 % under). torch's update holds three copies of the largest tensor beside the whole
    state (measured 2.98-3.00 at 10 MB and 1 GB): the 1B shape's peak. MLX: its phases as fitted, nothing taken off."""
    from common.costmodel.memory import ACTIVATION_FACTOR, HEAP_REUSED_BELOW_BYTES, UPDATE_TEMPORARIES
    from common.costmodel.model_memory import peak_phase
    from common.model.weights import parameter_shapes

    base = PRESETS["base"].with_(vocab_size=50257)
    small = sum(math.prod(s) * 4 for s in parameter_shapes(base).values()
                if math.prod(s) * 4 < HEAP_REUSED_BELOW_BYTES["torch"])
    whole = FullModel().trained_parameters(base) * 4
    assert 0 < small < whole
    torch_w, mlx_w = (Workload(base, 128, 8, framework=fw) for fw in ("torch", "mlx"))
    phase, parts = peak_phase(layout("ddp", 1), torch_w, FullModel(), None, 3e8)
    assert phase == "backward" and parts["gradients"] == whole  # counted once, in the activations' pages
    summed = ACTIVATION_FACTOR["torch"] * layout("ddp", 1).activation_bytes(torch_w)
    assert parts["activations"] == pytest.approx(summed - small)  # only the large gradients add to the sum
    phase, parts = peak_phase(layout("ddp", 1), mlx_w, FullModel(), None, 3e8)
    assert phase == "backward" and parts["activations"] == pytest.approx(
        ACTIVATION_FACTOR["mlx"] * layout("ddp", 1).activation_bytes(mlx_w))  # MLX: nothing taken off
    # the 1B shape at one rank: 67 MB and 1 GB matrices, the update's three copies of the largest are the peak
    one_b = base.with_(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, vocab_size=128256,
                       tie_embeddings=True)
    phase, parts = peak_phase(layout("ddp", 1), Workload(one_b, 128, 4, framework="torch"), FullModel(), None, 3e8)
    largest = max(math.prod(s) for s in parameter_shapes(one_b).values()) * 4
    assert phase == "update" and parts["update"] == UPDATE_TEMPORARIES["torch"] * largest
    assert parts["activations"] == 0 and parts["gradients"] == FullModel().trained_parameters(one_b) * 4
    lora = peak_phase(layout("ddp", 1), Workload(one_b, 128, 4, framework="torch"), Adapters(8, 16.0), None, 3e8)
    assert lora[0] != "update"  # the adapters' copies are small beside a step's activations
