"""`auto` for MLX's selectable kernels (--mlx-exp, --mlx-bf16-matmul, the cross-entropy's shift): the faster of the timings it is handed,
cached per machine, MLX version, kernel build and shape, and measured again when MLX changes. Nothing here times
anything: the timings are handed in."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from common.config import RunConfig
from common.kernels import (CANDIDATES, PIN_ENV, UNITS, Identity, KernelCache, describe, faster, fixed_choice,
                            measured_shape, pinned_kernels, was_contended)
from common.model.spec import preset

pytestmark = pytest.mark.usefixtures("kernels_measured")  # `auto` itself: the suite's pin lifted


@pytest.mark.parametrize(("timings", "expected"), [
    ({"native": 6.7, "fused": 5.3}, "fused"),
    ({"native": 4.9, "fused": 7.2}, "native"),
    ({"native": 365.0, "fp32": 34.5}, "fp32"),
    ({"native": 5.0, "fused": 5.0}, "native"),  # a tie keeps MLX's own, listed first
    ({"native": 6.2, "shift": 4.7, "tree": 5.6, "tree_shift": 4.2}, "tree_shift"),
])
def test_auto_picks_the_faster_of_the_timings_it_is_handed(timings, expected):
    assert faster(timings) == expected


@pytest.mark.parametrize(("cfg", "kernel", "device", "system", "expected"), [
    (RunConfig(), "exp", "cpu", "linux", None),                                   # auto on a Linux CPU: measure
    (RunConfig(dtype="bfloat16"), "bf16_matmul", "cpu", "linux", None),
    (RunConfig(), "bf16_matmul", "cpu", "linux", "native"),                       # no bf16 matmul in a float32 run
    (RunConfig(), "exp", "gpu", "linux", "native"),                               # CUDA: MLX's own
    (RunConfig(dtype="bfloat16"), "bf16_matmul", "gpu", "darwin", "native"),      # Metal untouched
    (RunConfig(), "exp", "cpu", "darwin", "native"),                              # macOS: Accelerate
    (RunConfig(mlx_exp="fused"), "exp", "gpu", "darwin", "fused"),                # a named choice is kept
    (RunConfig(mlx_exp="native"), "exp", "cpu", "linux", "native"),
    (RunConfig(mlx_bf16_matmul="fp32"), "bf16_matmul", "cpu", "linux", "fp32"),
    (RunConfig(mlx_exp="native"), "cross_entropy", "cpu", "linux", None),      # no flag: always timed there
    (RunConfig(), "cross_entropy", "gpu", "darwin", "native"),
    (RunConfig(), "attention", "cpu", "linux", None),                         # no flag: timed in float32
    (RunConfig(dtype="bfloat16"), "attention", "cpu", "linux", "whole"),      # bf16's core has no blocks
    (RunConfig(), "attention", "cpu", "darwin", "whole"),
])
def test_a_named_choice_is_kept_and_auto_measures_only_on_a_linux_cpu(cfg, kernel, device, system, expected):
    assert fixed_choice(cfg, kernel, device, system) == expected


def test_a_pin_fixes_what_auto_would_measure_and_nothing_a_flag_or_the_platform_decides(monkeypatch):
    """DPCOMPARE_MLX_KERNELS: runs made at different moments compute with the same kernels, whatever the load."""
    from common.errors import UserError
    from compare.machine.kernels import described

    monkeypatch.setenv(PIN_ENV, "native")
    assert [fixed_choice(RunConfig(), k, "cpu", "linux") for k in ("exp", "cross_entropy", "attention")] == \
        ["native", "native", "whole"]
    assert fixed_choice(RunConfig(dtype="bfloat16"), "bf16_matmul", "cpu", "linux") == "native"
    monkeypatch.setenv(PIN_ENV, "exp=fused, attention=halves")
    assert fixed_choice(RunConfig(), "exp", "cpu", "linux") == "fused"
    assert fixed_choice(RunConfig(mlx_exp="native"), "exp", "cpu", "linux") == "native"  # the flag wins
    assert fixed_choice(RunConfig(dtype="bfloat16"), "attention", "cpu", "linux") == "whole"  # bf16 has no blocks
    assert fixed_choice(RunConfig(), "cross_entropy", "cpu", "linux") is None  # not pinned: measured
    assert described(RunConfig(), "exp") == "fused (range reduction and a polynomial, vectorised by mx.compile; " \
        f"pinned by {PIN_ENV})"
    for bad in ("exp=slow", "softmax=native", "fused"):
        with pytest.raises(UserError, match=PIN_ENV):
            pinned_kernels(bad)


def test_the_measured_shapes_are_the_runs_own():
    cfg, spec = RunConfig(seq_len=128, global_batch_size=8), preset("tiny")
    assert measured_shape(cfg, "exp", spec) == (8, spec.n_heads, 128, 128)
    assert measured_shape(cfg, "bf16_matmul", spec) == (8 * 128, spec.dim, spec.ffn_dim)
    # the logits, and the exp the cross-entropy runs with (its index among the exp's candidates)
    assert measured_shape(cfg, "cross_entropy", spec, "fused") == (8 * 128, spec.vocab_size, 1)
    # q, k and v's shapes (heads and kv heads), timed with the run's exp too
    assert measured_shape(cfg, "attention", spec, "fused") == (8, spec.n_heads, spec.n_kv_heads, 128,
                                                                spec.head_dim, 1)


def test_a_cached_choice_is_reused_and_dropped_when_the_mlx_version_changes(tmp_path):
    cache, shape = KernelCache(tmp_path), (8, 4, 128, 128)
    old, new = Identity("cpu0", "0.32.4", "native-r1"), Identity("cpu0", "0.33.0", "native-r1")
    assert cache.get(old, "exp", shape) is None
    stored = cache.put(old, "exp", shape, {"native": 6.7, "fused": 5.3})
    assert stored["choice"] == "fused"
    assert cache.get(old, "exp", shape) == stored                      # reused
    assert cache.get(old, "exp", (16, 4, 128, 128)) is None            # another shape is measured on its own
    assert cache.get(Identity("cpu1", "0.32.4", "native-r1"), "exp", shape) is None  # another CPU
    assert cache.get(Identity("cpu0", "0.32.4", "baseline-r1"), "exp", shape) is None  # another kernel build
    assert cache.get(new, "exp", shape) is None                        # a new MLX measures again
    cache.put(new, "exp", shape, {"native": 4.0, "fused": 5.0})
    assert cache.get(new, "exp", shape)["choice"] == "native"
    assert cache.get(old, "exp", shape) is None                        # and the old version's entries are gone


def test_the_blas_a_timing_reached_is_part_of_its_key():
    from common.kernels import blas_of

    lib = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
    assert blas_of({}) == "own" and blas_of({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}) == "own"
    assert blas_of({"LD_PRELOAD": lib}) == "libopenblas:"
    assert blas_of({"LD_PRELOAD": lib, "OPENBLAS_CORETYPE": "SKYLAKEX"}) == "libopenblas:SKYLAKEX"
    own, openblas = (Identity.here("baseline", e) for e in ({}, {"LD_PRELOAD": lib}))
    assert own != openblas and own.build.startswith("baseline-own-")


def test_a_choice_timed_while_the_cpu_was_shared_is_timed_again_by_the_next_launch(tmp_path):
    assert not was_contended(None) and not was_contended(0.97) and was_contended(0.6)
    cache, shape, who = KernelCache(tmp_path), (8, 4, 2, 128, 16, 1), Identity("cpu0", "0.32.4", "native-r3")
    stored = cache.put(who, "attention", shape, {"whole": 73.6, "halves": 57.5, "quarters": 51.0}, cpu_share=0.62)
    assert cache.get(who, "attention", shape) is None                   # the launcher times it again
    assert cache.get(who, "attention", shape, contended=True) == stored  # its own ranks take it, as it chose
    cache.put(who, "attention", shape, {"whole": 6.6, "halves": 6.9, "quarters": 9.5}, cpu_share=0.99)
    assert cache.get(who, "attention", shape)["choice"] == "whole"       # timed alone: kept from now on
    # the machine's load beside each choice, for whoever wonders why one looks wrong (issue 72)
    if Path("/proc/loadavg").exists():
        kept = cache.get(who, "attention", shape)
        assert kept["load_1m"] >= 0 and kept["running_tasks"] >= 1 and kept["cpus"] >= 1
    # another CPU kind is another key: its first run times the kernel again
    assert cache.get(Identity("cpu1", "0.32.4", "native-r3"), "attention", shape) is None


def test_the_launcher_reads_the_cache_without_starting_a_measurement(tmp_path, monkeypatch):
    from compare.machine import kernels

    cfg = RunConfig(cache_dir=str(tmp_path), dtype="bfloat16", device="cpu", mlx_blas="bundled")  # no BLAS probe
    spec = cfg.model_spec(vocab_size=1051)  # the tokenizer's vocabulary, as prepare_inputs gives it
    for kernel, timings in (("exp", {"native": 9.8, "fused": 3.1}), ("bf16_matmul", {"native": 365.0, "fp32": 34.5}),
                            ("cross_entropy", {"native": 6.2, "shift": 4.7, "tree": 5.6, "tree_shift": 4.2})):
        ranks = kernels.env.child_env(kernels.timing_environment(cfg.mlx_cpu_jit, str(tmp_path), cfg.mlx_blas,
                                                                 cfg.threads_per_rank))  # the BLAS they load
        KernelCache(tmp_path).put(Identity.here(cfg.mlx_cpu_jit, ranks), kernel,
                                  measured_shape(cfg, kernel, spec, "fused"), timings)

    def no_child(*args, **kwargs):
        raise AssertionError("a cached choice started a measurement")

    monkeypatch.setattr(subprocess, "run", no_child)
    kernels._measured.cache_clear()
    line = kernels.kernels_line(cfg, spec)
    if fixed_choice(cfg, "exp", "cpu", __import__("sys").platform) is None:  # a Linux CPU: auto measured
        assert line == ("exp: fused (measured: fused 3.1, native 9.8 ns per element); "
                        "bf16 matmul: fp32 (measured: fp32 34.5, native 365 ps per multiply-add); "
                        "cross-entropy shift: tree_shift (measured: tree_shift 4.2, native 6.2, shift 4.7, tree 5.6 "
                        "ns per logit)")
        # without the run's model the vocabulary is not known here: the ranks time it
        assert kernels.kernels_line(cfg).endswith("cross-entropy shift: auto (timed by the ranks)")
    else:
        assert line.startswith("exp: native")


def test_the_description_names_the_choice_first_then_the_other_timings():
    entry = {"choice": "fused", "timings": {"native": 9.8, "fused": 3.1}}
    assert describe("exp", "fused", entry) == "fused (measured: fused 3.1, native 9.8 ns per element)"
    assert describe("exp", "native", None) == "native"
    assert set(CANDIDATES) == {"exp", "bf16_matmul", "cross_entropy", "attention"}
    assert all(kernel in UNITS for kernel in CANDIDATES)


def test_under_a_load_that_never_ends_a_choice_is_timed_at_most_max_tries_times_keeping_each_candidates_best(tmp_path):
    """A CI run's load never ends: every launch timed a contended kernel again. Now each timing again keeps each
    candidate's best time (load only slows a timing), and after MAX_TRIES the entry is kept."""
    from common.kernels import MAX_TRIES

    cache, shape, who = KernelCache(tmp_path), (8, 4, 128, 128), Identity("cpu0", "0.32.4", "native-r5")
    cache.put(who, "exp", shape, {"native": 9.0, "fused": 4.0}, cpu_share=0.5)
    assert cache.get(who, "exp", shape) is None
    cache.put(who, "exp", shape, {"native": 5.0, "fused": 6.0}, cpu_share=0.6)  # the second try, also under load
    second = cache.get(who, "exp", shape, contended=True)
    assert second["timings"] == {"native": 5.0, "fused": 4.0} and second["choice"] == "fused" and second["tries"] == 2
    assert cache.get(who, "exp", shape) is None  # still under load: once more
    cache.put(who, "exp", shape, {"native": 7.0, "fused": 8.0}, cpu_share=0.55)
    third = cache.get(who, "exp", shape)
    assert third is not None and third["tries"] == MAX_TRIES and third["choice"] == "fused"
