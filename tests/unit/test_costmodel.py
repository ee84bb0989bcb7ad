"""The cost model (common/costmodel/, each strategy's terms in common/parallel/): it reproduces its calibration run, its ring factors and byte counts
are the formulas and match what the runs count, and its memory per rank matches state_bytes."""
import json
import math

import pytest
from costmodel_fixtures import SPEC, link_record, summary

from common.costmodel.calibrate import calibrate
from common.costmodel.links import RING_FACTOR, Link, link_from_record, loopback_link
from common.costmodel.predict import predict
from common.costmodel.workload import Workload
from common.errors import UserError
from common.model.spec import ModelSpec, preset
from common.parallel import (collectives, comm_bytes_per_step_estimate, layout, local_parameters, state_fraction,
                             work_fraction)
from common.model.weights import num_parameters, parameter_shapes

TINY = ModelSpec.from_dict(SPEC)


@pytest.mark.parametrize("framework", ["mlx", "torch"])
def test_the_model_reproduces_its_calibration_run(framework):
    s = summary(framework, 1)
    p = predict(calibrate(s, TINY), "ddp", 1, None)
    assert p.step_s == pytest.approx(s["step_time_s"], rel=1e-9)
    assert p.tokens_per_s == pytest.approx(s["tokens_per_step"] / s["step_time_s"], rel=1e-9)
    assert (p.comm_s, p.efficiency) == (0, pytest.approx(1.0))
    assert p.memory_bytes["total"] == pytest.approx(max(s["peak_rss_bytes"]), rel=1e-9)  # overhead calibrated


@pytest.mark.parametrize("framework", ["mlx", "torch"])
def test_a_two_rank_calibration_run_with_a_link_is_reproduced_and_gives_the_overlap(framework):
    backend = {"mlx": "ring", "torch": "gloo"}[framework]
    s = summary(framework, 2, link=link_record("1gbit", backend=backend))
    cal = calibrate(s, TINY)
    link = link_from_record(s["link"])
    full = collectives("ddp", cal.workload, 2)[0].seconds(link, 2)
    exposed = s["breakdown"]["communication"]
    if framework == "mlx":  # 3.8 ms exposed of 6.0 ms modelled: part of the sync overlapped
        assert (cal.overlap, cal.sync_overhead_s) == (pytest.approx(1 - exposed / full), 0.0)
    else:  # 6.2 ms exposed, more than the modelled 6.0: no overlap, and the excess a fixed cost per step
        assert (cal.overlap, cal.sync_overhead_s) == (0.0, pytest.approx(exposed - full))
    p = predict(cal, "ddp", 2, link)
    assert p.step_s == pytest.approx(s["step_time_s"], rel=1e-9)
    assert p.memory_bytes["total"] == pytest.approx(max(s["peak_rss_bytes"]), rel=1e-9)


@pytest.mark.parametrize("framework", ["mlx", "torch"])
def test_an_older_two_rank_run_without_a_link_record_is_reproduced_too(framework):
    s = summary(framework, 2)  # no `link`: the overlap is measured against the loopback figures
    cal = calibrate(s, TINY)
    assert "loopback" in cal.notes[0]
    p = predict(cal, "ddp", 2, loopback_link(s["backend"]))
    assert p.step_s == pytest.approx(s["step_time_s"], rel=1e-9)
    # Its sync overhead does not grow with the link's time: over 1 Gbit/s the step grows by the bytes' time only
    slow = predict(cal, "ddp", 2, Link.wire(1, 100))
    assert slow.exposed_comm_s - p.exposed_comm_s == pytest.approx(
        (1 - cal.overlap) * (slow.comm_s - p.comm_s), rel=1e-9)


def test_predicting_two_ranks_from_one_on_the_recorded_run():
    """The fixture's measured N=2 steps (loopback, 2 busy cores): 0.074 s (MLX ring), 0.040 s (torch gloo).
    From N=1 and the loopback figures the model gives 0.063 and 0.036: 15 % and 9 % low, because on two
    shared cores the measured exposed communication (3.8 ms, 6.2 ms) is several times the isolated
    all-reduce of 0.6 MB. The bound here is that measurement, not a tolerance to aim for."""
    for framework, backend, limit in (("mlx", "ring", 0.16), ("torch", "gloo", 0.10)):
        measured = summary(framework, 2)["step_time_s"]
        p = predict(calibrate(summary(framework, 1), TINY), "ddp", 2, loopback_link(backend))
        assert abs(p.step_s / measured - 1) < limit


def test_ring_factors_and_latency_terms():
    link = Link("x", hop_latency_s=1e-4, bandwidth_Bps=1e9)
    for n in (2, 4, 64):
        assert RING_FACTOR["all_reduce"](n) == 2 * (n - 1) / n
        assert RING_FACTOR["all_gather"](n) == RING_FACTOR["reduce_scatter"](n) == (n - 1) / n
        assert link.all_reduce_s(1e8, n) == pytest.approx(2 * (n - 1) * 1e-4 + 2 * (n - 1) / n * 1e8 / 1e9)
        assert link.all_gather_s(1e8, n) == pytest.approx((n - 1) * 1e-4 + (n - 1) / n * 1e8 / 1e9)
    # A measured all-reduce t(S) = latency + S / bandwidth at N_m, inverted through the ring, gives it back.
    for n in (2, 8):
        measured = Link.from_allreduce("m", 3e-4, 2e9, n)
        for size in (4096, 32 * 2**20):
            assert measured.all_reduce_s(size, n) == pytest.approx(3e-4 + size / 2e9)
    # At N=2 a ring all-reduce sends the payload once each way: bus and algorithm bandwidth coincide.
    assert Link.from_allreduce("m", 2e-4, 1e9, 2).bandwidth_Bps == 1e9


@pytest.mark.parametrize("framework", ["mlx", "torch"])
def test_bytes_per_step_match_the_formulas_and_the_runs_counts(framework):
    s = summary(framework, 2)
    w = calibrate(s, TINY).workload
    ddp = collectives("ddp", w, 2)
    assert sum(c.nbytes * c.calls for c in ddp) == s["comm_bytes_per_step"] == 4 * num_parameters(TINY)
    assert sum(c.wire_bytes(2) for c in ddp) == s["comm_bytes_per_step"]  # 2 (N-1)/N = 1 at N=2
    tp = collectives("tp", w, 2)
    assert sum(c.nbytes * c.calls for c in tp) == comm_bytes_per_step_estimate("tp", TINY, 2, 32, 128, 1)
    bf16 = collectives("tp", Workload(TINY, 128, 32, dtype="bfloat16"), 2)
    assert sum(c.nbytes * c.calls for c in bf16) * 2 == sum(c.nbytes * c.calls for c in tp)  # activations by dtype
    assert collectives("ddp", w, 1) == []


def test_fsdp_gathers_once_in_mlx_blocks_twice_in_torch_and_the_all_sum_slice_fallback_moves_double():
    w = Workload(TINY, 128, 32, grad_accum=2, framework="mlx")
    native, fallback = collectives("fsdp", w, 4, "native"), collectives("fsdp", w, 4, "all_sum_slice")
    params = 4 * num_parameters(TINY) - 4 * TINY.dim  # the final norm stays replicated in MLX
    gathers = next(c for c in native if c.kind == "all_gather")
    assert gathers.nbytes * gathers.calls == 2 * params  # the forward's gather, reused by the backward, per micro-step
    scatter = next(c for c in native if c.kind == "reduce_scatter")
    summed = next(c for c in fallback if c.kind == "all_reduce")
    assert summed.wire_bytes(4) == 2 * scatter.wire_bytes(4)
    assert scatter.calls == 2 * (2 + 2)  # MLX: every micro-step, per unit (2 blocks, embedding, head)
    assert next(c for c in native if c.what == "replicated gradients").nbytes == 4 * TINY.dim  # the final norm
    torch_fsdp = collectives("fsdp", Workload(TINY, 128, 32, grad_accum=2, framework="torch"), 4)
    # FSDP2: once a step, per unit (2 blocks, the embedding, the head, the root: the final norm), all sharded
    assert next(c for c in torch_fsdp if c.kind == "reduce_scatter").calls == 5
    gathered = next(c for c in torch_fsdp if c.kind == "all_gather")
    # per micro-step: every unit for the forward and the blocks again for the backward (FSDP2 frees a block
    # after its forward; the head stays gathered, the embedding's backward needs no weights, the root stays);
    # one collective of the gathers' mean size, rounded down to whole bytes: off by less than a byte per call
    blocks = sum(math.prod(s) for k, s in parameter_shapes(TINY).items() if k.startswith("model.layers."))
    assert gathered.calls == 2 * (2 * 2 + 3)
    assert gathered.nbytes * gathered.calls == pytest.approx(2 * 4 * (num_parameters(TINY) + blocks), abs=gathered.calls)


def test_state_per_rank_matches_what_the_runs_hold():
    """fixtures: state_bytes params 632064 per rank at N=1 and 2 (ddp); on `small` (GPT-2's 50257 tokens) both
    frameworks' fsdp hold 0.5x ddp's state per rank (measured, docs/benchmarks.md: MLX pads the vocabulary
    as FSDP2 does since issue 25; it held 0.95x when it kept the vocabulary replicated)."""
    assert local_parameters("ddp", TINY, 2) * 4 == summary("torch", 2)["state_bytes"]["params"][0]
    small = preset("small")
    assert local_parameters("fsdp", small, 2, "mlx") / num_parameters(small) == pytest.approx(0.5, abs=0.01)
    assert local_parameters("fsdp", small, 2, "torch") / num_parameters(small) == pytest.approx(0.5, abs=0.01)
    w = Workload(small, 128, 8)
    assert 0.5 < state_fraction("tp", w, 2) < 1  # the vocabulary matrices are replicated under tp


def test_tp_work_is_the_split_layers_plus_the_replicated_head():
    w = Workload(preset("base"), 512, 8)
    assert work_fraction("ddp", w, 4) == work_fraction("fsdp", w, 4) == 0.25
    d, kv, ffn, layers, vocab, seq = 768, 3 * 64, 3072, 12, 50000, 512
    split = 6 * layers * (2 * d * d + 2 * kv * d + 3 * d * ffn) + 12 * layers * seq * d  # per token, split over N
    head = 6 * vocab * d                                                                 # replicated
    for n in (2, 4):
        assert work_fraction("tp", w, n) == pytest.approx((split / n + head) / (split + head))


def test_memory_fits_or_not_and_the_bottleneck_names_it():
    cal = calibrate(summary("torch", 1), TINY)
    link = Link.wire(1, 100)
    p = predict(cal, "fsdp", 2, link)
    assert predict(cal, "fsdp", 2, link, device_memory_bytes=p.memory_bytes["total"] * 1.01).fits is True
    tight = predict(cal, "fsdp", 2, link, device_memory_bytes=p.memory_bytes["total"] * 0.99)
    assert tight.fits is False and tight.bottleneck.startswith("memory:")
    assert predict(cal, "fsdp", 2, link).fits is None
    assert predict(cal, "fsdp", 4, link).memory_bytes["params"] < predict(cal, "ddp", 4, link).memory_bytes["params"]


def test_a_slow_link_is_named_as_the_bottleneck():
    cal = calibrate(summary("torch", 1), TINY)
    slow = predict(cal, "ddp", 8, Link.wire(0.01, 500, name="10 Mbit/s"))
    assert slow.exposed_share > 0.5 and slow.bottleneck.startswith("the link: 10 Mbit/s needs")
    assert "MB of gradients" in slow.bottleneck
    fast = predict(cal, "ddp", 2, Link.wire(400, 1))
    assert fast.bottleneck.startswith("compute:")


def test_link_records_old_runs_and_bad_input():
    assert link_from_record(None) is None and link_from_record({}) is None
    rec = link_record("200mbit", latency_s=4e-4, bandwidth_Bps=2.3e7)
    assert link_from_record(rec).all_reduce_s(1e6, 2) == pytest.approx(4e-4 + 1e6 / 2.3e7)
    # An fsdp run's own all-gather, where recorded, times the all-gathers; reduce-scatters keep the all-reduce's.
    gathered = link_from_record({**rec, "allgather": {"latency_s": 5e-4, "bandwidth_Bps": 1e7, "world_size": 2}})
    assert gathered.all_gather_s(1e6, 2) == pytest.approx(5e-4 + 1e6 / 1e7)
    assert gathered.reduce_scatter_s(1e6, 2) == pytest.approx(link_from_record(rec).all_gather_s(1e6, 2))
    assert gathered.all_reduce_s(1e6, 2) == pytest.approx(4e-4 + 1e6 / 2.3e7)
    tcp_only = {**rec, "allreduce": None}
    assert link_from_record(tcp_only).bandwidth_Bps == rec["tcp_bandwidth_Bps"]
    no_breakdown = {**summary("mlx", 1), "breakdown": None}
    with pytest.raises(UserError, match="no time breakdown"):
        calibrate(no_breakdown, TINY)
    with pytest.raises(UserError, match="allowed"):
        collectives("zero", Workload(TINY, 128, 32), 2)
    with pytest.raises(UserError, match="needs 2 or more"):
        predict(calibrate(summary("mlx", 1), TINY), "fsdp", 1, None)
    with pytest.raises(UserError):
        Link("bad", -1.0, 1e9)
    assert math.isclose(Link.wire(8, 0).bandwidth_Bps, 1e9)


# ---- pp -----------------------------------------------------------------------------------------
def test_pp_holds_its_stage_runs_the_slowest_stage_stretched_by_the_bubble_and_sends_each_piece_twice():
    from common.parallel.pipeline import bubble_fraction, comm_bytes_per_step, stage_of

    w = Workload(TINY, 128, 32, pp_microbatches=4)
    shapes = {k: math.prod(v) for k, v in parameter_shapes(TINY).items()}
    last = sum(v for k, v in shapes.items() if stage_of(k, TINY.n_layers, 2) == 1)
    first = sum(v for k, v in shapes.items() if stage_of(k, TINY.n_layers, 2) == 0)
    assert local_parameters("pp", TINY, 2) == max(first, last)
    # The bubble: M + p - 1 slots of one piece each, (p - 1) / (M + p - 1) of them idle.
    stretch = work_fraction("pp", w, 2) / work_fraction("pp", Workload(TINY, 128, 32, pp_microbatches=10**9), 2)
    assert 1 - 1 / stretch == pytest.approx(bubble_fraction(2, 4))
    assert 0.5 < work_fraction("pp", Workload(TINY, 128, 32, pp_microbatches=10**9), 2) < 1  # the head's stage
    # Each boundary carries the whole batch's activations down and their gradients up (common/parallel/pipeline.py).
    sends = collectives("pp", w, 2)
    assert sum(c.calls * c.nbytes for c in sends) == 2 * comm_bytes_per_step(32, 128, TINY.dim)
    assert sum(c.wire_bytes(2) for c in sends) == 2 * comm_bytes_per_step(32, 128, TINY.dim)


def test_pp_over_a_slow_link_is_paced_by_its_sends_and_over_a_fast_one_by_its_slowest_stage():
    for framework, messages in (("mlx", lambda m: 2 * m), ("torch", lambda m: m + 1)):
        cal = calibrate(summary(framework, 1), TINY)
        fast, slow = predict(cal, "pp", 2, Link.wire(1000, 1)), predict(cal, "pp", 2, Link.wire(0.01, 1))
        piece = collectives("pp", cal.workload, 2)[0].nbytes
        m = cal.workload.pp_microbatches
        assert fast.exposed_comm_s < 0.05 * fast.compute_s
        send_s = Link.wire(0.01, 1).send_s(piece, 2)
        # link-bound, 1f1b over two stages, a few pieces' compute between the messages. MLX's order: the 2M
        # messages one after another (a piece's gradient leaves the last stage after the next activation has
        # arrived). torch's: that gradient leaves with the next receive posted, so it crosses while the next
        # activation comes down, and M + 1 messages' time is the step's (common/parallel/pipeline_timing.py)
        rest = cal.optimizer_s * state_fraction("pp", cal.workload, 2) + cal.other_s
        slot = (cal.forward_s + cal.backward_s) * work_fraction("pp", cal.workload, 2) / (m + 1)
        assert send_s > 10 * slot  # link-bound indeed
        assert messages(m) * send_s < slow.step_s - rest < messages(m) * send_s + (m + 1) * slot, framework
        assert "the link" in slow.bottleneck


# ---- the predicted peak per rank (summary.json's memory_prediction, the report's memory table) ----------
def test_the_predicted_peak_adds_the_fixed_footprint_to_what_the_rank_holds():
    from common.costmodel.memory import REDUCE_FACTOR, UPDATE_FACTOR, WORKSPACE_BYTES, predicted_peak

    small = preset("small")  # GPT-2's 50257 tokens: both frameworks pad them to 50258 and shard them
    matrix_bytes = 50258 * small.dim * 4  # one padded vocabulary matrix, fp32
    block_bytes = 4 * sum(math.prod(v) for k, v in parameter_shapes(small).items() if k.startswith("model.layers.0."))
    fixed = 300e6
    torch_ddp, torch_fsdp = (predicted_peak(s, Workload(small, 128, 8), 2, fixed) for s in ("ddp", "fsdp"))
    mlx_ddp, mlx_fsdp = (predicted_peak(s, Workload(small, 128, 8, framework="mlx"), 2, fixed) for s in ("ddp", "fsdp"))
    for framework, p in (("torch", torch_ddp), ("torch", torch_fsdp), ("mlx", mlx_ddp), ("mlx", mlx_fsdp)):
        step = sum(v for k, v in p.items()
                   if k not in ("total", "step", "after_backward", "saving", "peak_at", "checkpoint"))
        assert p["step"] == pytest.approx(step) and p["total"] == max(p["step"], p["after_backward"], p["saving"])
        # torch's gradients under 32 MB are written into the freed activations' pages: `small`'s block matrices
        assert (p["reused_pages"] < 0) == (framework == "torch") and -p["reused_pages"] <= p["activations"]
        assert p["fixed"] == fixed and p["workspace"] == WORKSPACE_BYTES[framework]
        assert p["update"] == UPDATE_FACTOR[framework] * p["params"] and p["optimizer"] == 2 * p["params"]
    # both hold half the state; torch gathers two blocks at a time and, at the head's backward, its whole
    # parameter and gradient (the embedding and the head are FSDP units of their own)
    assert torch_fsdp["params"] == pytest.approx(torch_ddp["params"] / 2, rel=1e-3)
    assert mlx_fsdp["params"] == pytest.approx(torch_ddp["params"] / 2, rel=1e-3)
    assert torch_fsdp["gathered"] == 2 * block_bytes + 2 * matrix_bytes and torch_ddp["gathered"] == 0
    # ddp at N=2 holds copies of its gradients for the all-reduce (MLX's concatenation, torch's rebuilt buckets)
    assert mlx_ddp["reduce"] == REDUCE_FACTOR["mlx"] * mlx_ddp["grads"] > 0 == mlx_fsdp["reduce"] == torch_fsdp["reduce"]
    assert torch_ddp["reduce"] == REDUCE_FACTOR["torch"] * torch_ddp["grads"] > 0
    # MLX holds as much (measured: its fsdp peak does not grow with the depth beyond the shards)
    assert mlx_fsdp["gathered"] == 2 * block_bytes + 2 * matrix_bytes and mlx_ddp["gathered"] == 0
    tp = predicted_peak("tp", Workload(small, 128, 8), 2, fixed)  # every tp rank reads the whole batch
    assert tp["activations"] > torch_ddp["activations"]
    # saving an hf checkpoint streams the state: fsdp's rank 0 holds one gathered tensor at a time (the
    # largest: a vocabulary matrix), the other ranks nothing; the sharded format writes each rank's own arrays
    largest = 4 * max(math.prod(s) for s in parameter_shapes(small).values())
    assert [predicted_peak("fsdp", Workload(small, 128, 8), 2, fixed, rank)["checkpoint"] for rank in (0, 1)] == \
        [largest, 0.0]
    sharded = predicted_peak("fsdp", Workload(small, 128, 8), 2, fixed, 0, "sharded")
    assert sharded["checkpoint"] == 0 and sharded["total"] <= torch_fsdp["total"]  # torch writes from views


def test_the_memory_record_compares_each_rank_with_its_measured_peak(tmp_path):
    from common.costmodel.memory import predicted_peak
    from compare.plan import add_memory_predictions
    from costmodel_fixtures import write_run

    s = summary("torch", 2)
    s["fixed_rss_bytes"] = [370e6, 371e6]
    run = write_run(tmp_path / "torch-n2", s)
    add_memory_predictions([run])
    record = json.loads((run / "summary.json").read_text())["memory_prediction"]
    assert record["basis"] == "peak RSS" and record["measured_bytes"] == s["peak_rss_bytes"]
    assert record["peak_bytes"][1] - record["peak_bytes"][0] == pytest.approx(1e6)  # each rank's own fixed
    assert record["error"] == [pytest.approx(p / m - 1) for p, m in zip(record["peak_bytes"], s["peak_rss_bytes"])]
    # the fixture run peaked at 474 MB; 370 MB is torch's fixed footprint measured at a rank's start on that machine
    assert all(abs(e) < 0.15 for e in record["error"])
    s.update(device="cuda:0", status="ok")
    write_run(tmp_path / "gpu", s)
    add_memory_predictions([tmp_path / "gpu"])
    gpu = json.loads((tmp_path / "gpu" / "summary.json").read_text())["memory_prediction"]
    assert gpu["basis"] == "framework peak" and gpu["parts"]["fixed"] == gpu["parts"]["workspace"] == 0
    # a mesh's run is predicted over its axes (it was "no prediction: --strategy mesh needs --mesh" before)
    s = summary("torch", 2, "mesh")
    s["config"]["mesh"] = "tp=2"
    mesh = write_run(tmp_path / "torch-tp2-n2", s)
    add_memory_predictions([mesh])
    record = json.loads((mesh / "summary.json").read_text())["memory_prediction"]
    assert "note" not in record and record["parts"]["params"] == \
        predicted_peak("tp", Workload(TINY, 32, 8), 2, 0.0)["params"] < record["parts"]["total"]


def test_fsdp_on_a_cpu_adds_fsdp2_host_work_in_torch_and_hides_part_of_mlx_collectives():
    """FSDP_HOST_S_PER_CALL per gather and reduce-scatter call (torch), the heap torch's fsdp releases in its
    backward on Linux without --tune-malloc (HEAP_RELEASE_BYTES_PER_S), and FSDP_HIDDEN_SHARE of the forward
    and backward (MLX), fitted on the reference machine (docs/scaling.md, docs/benchmarks.md); a calibration on
    paper (a GPU nobody measured) gets none of them."""
    from dataclasses import replace

    from common.parallel.fsdp import FSDP_HIDDEN_SHARE, FSDP_HOST_S_PER_CALL, HEAP_RELEASE_BYTES_PER_S

    link = Link.wire(1, 100)
    torch_cal = calibrate(summary("torch", 1), TINY)
    assert torch_cal.on_cpu and torch_cal.releases_heap
    on_cpu, on_paper = (predict(c, "fsdp", 2, link) for c in (torch_cal, replace(torch_cal, on_cpu=False)))
    calls = sum(c.calls for c in collectives("fsdp", torch_cal.workload, 2))  # gathers and reduce-scatters only
    heap = layout("fsdp", 2).heap_release_bytes(torch_cal.workload) / HEAP_RELEASE_BYTES_PER_S["torch"]
    assert heap > 0
    assert on_cpu.compute_s - on_paper.compute_s == pytest.approx(FSDP_HOST_S_PER_CALL["torch"] * calls + heap)
    tuned = calibrate({**summary("torch", 1), "config": {"tune_malloc": True}}, TINY)
    assert not tuned.releases_heap  # --tune-malloc keeps the heap: no release to pay for
    assert on_cpu.compute_s - predict(tuned, "fsdp", 2, link).compute_s == pytest.approx(heap)
    assert on_cpu.exposed_comm_s == on_paper.exposed_comm_s
    mlx_cal = calibrate(summary("mlx", 1), TINY)
    on_cpu, on_paper = (predict(c, "fsdp", 2, link) for c in (mlx_cal, replace(mlx_cal, on_cpu=False)))
    hidden = FSDP_HIDDEN_SHARE["mlx"] * (mlx_cal.forward_s + mlx_cal.backward_s) / 2
    assert on_paper.exposed_comm_s - on_cpu.exposed_comm_s == pytest.approx(min(hidden, on_paper.exposed_comm_s))
    assert on_cpu.compute_s == on_paper.compute_s


def test_a_pipeline_piece_past_the_backends_buffers_holds_its_sender_and_the_plan_pays_for_it():
    """base's pieces (786 KB) are past Open MPI's 64 KiB eager limit and within a socket's 4 MiB: on mpi each send
    waits for its receive (pipeline_timing.py's rendezvous), which a played step never makes shorter."""
    from dataclasses import replace as with_

    from common.parallel.pipeline import sender_waits

    assert sender_waits("mpi", 786_432) and not sender_waits("ring", 786_432) and not sender_waits("nccl", 1e12)
    cal = calibrate(summary("mlx", 1), TINY)
    w = with_(cal.workload, global_batch_size=64, seq_len=256, pp_microbatches=4)   # 16-row pieces: 1 MB
    cal = with_(cal, workload=w)
    slow = Link.wire(1, 100)
    on_ring, on_mpi = (predict(cal, "pp", 2, slow, backend=b) for b in ("ring", "mpi"))
    assert on_mpi.exposed_comm_s > on_ring.exposed_comm_s > 0
    small = with_(cal, workload=with_(w, global_batch_size=4, seq_len=8))   # 1-row pieces of 8 tokens: buffered
    assert (predict(small, "pp", 2, slow, backend="mpi").exposed_comm_s
            == predict(small, "pp", 2, slow, backend="ring").exposed_comm_s)
