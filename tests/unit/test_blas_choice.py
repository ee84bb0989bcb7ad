"""MLX's BLAS on Linux (compare/machine/blas.py): the OpenBLAS wheel, a system OpenBLAS or MLX's reference BLAS,
each checked in a child before any rank starts, the fastest that works chosen by measurement and cached."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from common.errors import UserError
from common.kernels import KernelCache
from compare.machine import blas

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MLX uses Accelerate on macOS")


@pytest.fixture(autouse=True)
def fresh_choices():
    blas._choose.cache_clear()
    yield
    blas._choose.cache_clear()


def fake_candidates(monkeypatch, gflops: dict, errors: dict | None = None) -> list[str]:
    """Candidates whose probe answers `gflops` (or an error); returns the names probed, in order."""
    probed: list[str] = []
    errors = errors or {}

    def probe(candidate, extra_env):
        probed.append(candidate.name)
        if candidate.name in errors:
            return {"error": errors[candidate.name]}
        return {"gflops": gflops[candidate.name], "relative_error": 1e-7, "cpu_share": 1.0, "core": "Zen"}

    monkeypatch.setattr(blas, "probe", probe)
    monkeypatch.setattr(blas, "kernels_for", lambda library: ("core Zen", {}))
    monkeypatch.setattr(blas, "wheel_candidate", lambda root: blas.Candidate("wheel", "/x/libopenblas.so.0", "whl 1"))
    monkeypatch.setattr(blas, "system_candidate", lambda: blas.Candidate("system", "/usr/lib/libopenblas.so.0",
                                                                         "/usr/lib/libopenblas.so.0"))
    monkeypatch.setattr(blas, "bundled_candidate", lambda: blas.Candidate("bundled", "/x/libblas.so", "reference"))
    monkeypatch.setattr(sys, "platform", "linux")
    return probed


@pytest.mark.parametrize(("system", "wheel", "expected"), [(120.0, 90.0, "system"), (80.0, 95.0, "wheel")])
def test_auto_takes_the_faster_openblas_by_measurement_and_records_every_timing(monkeypatch, tmp_path, system, wheel,
                                                                                expected):
    fake_candidates(monkeypatch, {"system": system, "wheel": wheel, "bundled": 5.0})
    chosen = blas.choose("auto", str(tmp_path))
    assert chosen.kind == "openblas" and chosen.chosen == "auto" and chosen.fix is None
    assert chosen.gflops == {"system": system, "wheel": wheel, "bundled": 5.0}
    assert chosen.description.startswith("openblas wheel" if expected == "wheel" else "openblas (")
    assert f"system {system:.1f}" in chosen.description and f"wheel {wheel:.1f}" in chosen.description
    library = {"system": "/usr/lib/libopenblas.so.0", "wheel": "/x/libopenblas.so.0"}[expected]
    assert chosen.env["LD_PRELOAD"].split()[0] == library


def test_a_library_that_crashes_is_never_picked_and_the_verdict_gets_the_fix(monkeypatch, tmp_path):
    fake_candidates(monkeypatch, {"bundled": 5.0}, errors={"wheel": "killed by SIGILL (built for another CPU)",
                                                           "system": "missing dependency: libgfortran.so.5"})
    chosen = blas.choose("auto", str(tmp_path))
    assert chosen.kind == "reference" and chosen.env == {} and chosen.fix
    assert "wheel rejected: killed by SIGILL" in chosen.description
    assert "system rejected: missing dependency: libgfortran.so.5" in chosen.description


def test_the_choice_is_cached_and_timed_again_when_it_was_timed_under_load(monkeypatch, tmp_path):
    probed = fake_candidates(monkeypatch, {"system": 80.0, "wheel": 95.0, "bundled": 5.0})
    blas.choose("auto", str(tmp_path))
    assert sorted(probed) == ["bundled", "system", "wheel"]
    blas._choose.cache_clear()
    blas.choose("auto", str(tmp_path))
    assert len(probed) == 3  # read from kernel-choice.json
    cache = KernelCache(tmp_path)
    entries = __import__("json").loads(cache.path.read_text())
    (key, entry), = entries.items()
    assert {"load_1m", "running_tasks", "cpus", "cpu_share"} <= set(entry) or not Path("/proc/loadavg").exists()
    entry["cpu_share"] = 0.5  # as a timing beside a busy loop on each core reads
    cache.path.write_text(__import__("json").dumps({key: entry}))
    blas._choose.cache_clear()
    blas.choose("auto", str(tmp_path))
    assert len(probed) == 6
    for _ in range(3):  # timed again under load at most MAX_TRIES times in all, then kept
        entries = __import__("json").loads(cache.path.read_text())
        entries[key]["cpu_share"] = 0.5
        cache.path.write_text(__import__("json").dumps(entries))
        blas._choose.cache_clear()
        blas.choose("auto", str(tmp_path))
    assert len(probed) == 3 * blas.MAX_TRIES


def test_a_timing_again_keeps_each_librarys_best_figure(monkeypatch, tmp_path):
    """Load only slows a timing: a second timing under load does not lower what the first one measured."""
    fake_candidates(monkeypatch, {"system": 80.0, "wheel": 95.0, "bundled": 5.0})
    first = blas._timed([blas.system_candidate(), blas.wheel_candidate(tmp_path)], KernelCache(tmp_path),
                        blas.Identity("m", "v", "b"), {})
    fake_candidates(monkeypatch, {"system": 40.0, "wheel": 100.0, "bundled": 2.0})
    second = blas._timed([blas.system_candidate(), blas.wheel_candidate(tmp_path)], KernelCache(tmp_path),
                         blas.Identity("m", "v", "b"), first)
    assert second["gflops"] == {"system": 80.0, "wheel": 100.0, "bundled": 5.0} and second["tries"] == 2
    assert second["choice"] == "wheel" and second["cores"]["wheel"] == ["core Zen", {}]


def test_bundled_by_flag_is_the_reference_blas_with_the_fix(monkeypatch):
    monkeypatch.setattr(sys, "platform", "linux")
    chosen = blas.choose("bundled")
    assert chosen.kind == "reference" and chosen.chosen == "flag" and "--mlx-blas auto" in chosen.fix
    assert blas.summary_fields("mlx", "bundled")["blas_kind"] == "reference"
    assert blas.summary_fields("torch", "bundled")["blas_kind"] == "framework's own"


def test_a_named_library_that_is_missing_or_broken_is_one_line_of_error(monkeypatch, tmp_path):
    fake_candidates(monkeypatch, {}, errors={"wheel": "killed by SIGILL (built for another CPU)"})
    with pytest.raises(UserError, match="--mlx-blas wheel: .* does not work here: killed by SIGILL"):
        blas.choose("wheel", str(tmp_path))
    monkeypatch.setattr(blas, "system_candidate", lambda: None)
    with pytest.raises(UserError, match="--mlx-blas system: no system OpenBLAS found"):
        blas.choose("system", str(tmp_path))


@linux_only
def test_a_file_that_is_no_library_fails_the_real_probe(tmp_path):
    fake = tmp_path / "libopenblas.so.0"
    fake.write_bytes(b"not an ELF file")
    result = blas.probe(blas.Candidate("wheel", str(fake), "fake"), {})
    assert "error" in result and "gflops" not in result


@linux_only
def test_the_wheel_loads_without_a_system_fortran_runtime_and_computes_right(tmp_path):
    """The wheel through the private folder of links: its libgfortran from the venv, found by its own RPATH."""
    candidate = blas.wheel_candidate(tmp_path)
    if candidate is None:
        pytest.skip(f"{blas.WHEEL} is not installed here (not Linux x86-64)")
    folder = Path(candidate.library).parent
    assert os.path.realpath(folder / "libopenblas.so.0").endswith(".so")
    result = blas.probe(candidate, {})
    assert "error" not in result, result
    assert result["relative_error"] < 1e-5 and result["core"]


@pytest.mark.parametrize(("timings", "share", "again"), [
    ({"wheel": 21.0, "bundled": 400.0}, 0.5, False),   # 19x: no load flips that
    ({"wheel": 21.0, "system": 25.0}, 0.5, True),      # 1.2x under a half share: timed again
    ({"wheel": 21.0, "system": 25.0}, 0.95, False),    # alone on its core: kept
    ({"wheel": 21.0, "system": 25.0}, None, False),    # an entry from before the share was recorded
])
def test_a_choice_timed_under_load_is_timed_again_only_where_the_load_could_have_made_it(timings, share, again):
    assert blas.load_explains({"timings": timings, "cpu_share": share}) is again


@linux_only
def test_a_library_that_dies_of_an_illegal_instruction_is_rejected_before_any_rank_starts(tmp_path):
    """A stand-in for an OpenBLAS built for another CPU (cmeel-openblas's SKYLAKEX build on an AVX2 machine): a
    library whose first code run is an illegal instruction (ud2, SIGILL), built here with the C compiler."""
    import shutil
    import subprocess

    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in library")
    source = tmp_path / "boom.c"
    source.write_text("__attribute__((constructor)) static void boom(void) { __builtin_trap(); }\n"
                      "void cblas_sgemm(void) {}\n")
    library = tmp_path / "libopenblas.so.0"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(library), str(source)], check=True, capture_output=True)
    result = blas.probe(blas.Candidate("wheel", str(library), "stand-in"), {})
    assert result == {"error": "killed by SIGILL (built for another CPU)"}
