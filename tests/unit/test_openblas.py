"""OpenBLAS's kernels for MLX: a generic core that OpenBLAS falls back to is replaced by the one the CPU's flags
allow (compare/machine/openblas.py), unless the user set OPENBLAS_CORETYPE."""
from __future__ import annotations

import pytest

from compare.machine import environment as env
from compare.machine import openblas

AVX512 = frozenset({"sse3", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl"})
AVX2 = frozenset({"sse3", "avx", "avx2", "fma"})
SSE = frozenset({"sse3", "ssse3", "sse4_2"})


@pytest.mark.parametrize(("detected", "flags", "vendor", "expected"), [
    ("Prescott", AVX512, "GenuineIntel", "SKYLAKEX"),   # the Intel VM: "Intel(R) Xeon(R) Processor"
    ("Prescott", AVX512, "AuthenticAMD", "SKYLAKEX"),   # an AVX-512 Zen 4/5 misread
    ("Nehalem", AVX2, "GenuineIntel", "HASWELL"),
    ("Prescott", AVX2, "AuthenticAMD", "ZEN"),          # Zen 1-3
    ("Haswell", AVX512, "GenuineIntel", "SKYLAKEX"),    # AVX2 kernels on an AVX-512 CPU
    ("Cooperlake", AVX512, "AuthenticAMD", None),       # Zen 4 here: OpenBLAS's own choice stands
    ("SkylakeX", AVX512, "GenuineIntel", None),
    ("Zen", AVX2, "AuthenticAMD", None),
    ("Prescott", SSE, "GenuineIntel", None),            # nothing wider to choose
    ("Prescott", AVX2 - {"fma"}, "GenuineIntel", None),  # HASWELL's kernels need FMA
])
def test_a_core_below_what_the_cpu_flags_allow_is_replaced(detected, flags, vendor, expected):
    assert openblas.choose_coretype(detected, flags, vendor) == expected


def test_the_vms_fallback_emulated_here_would_get_skylakex(monkeypatch):
    """OPENBLAS_CORETYPE=PRESCOTT makes this library report what the Intel VM's did; with that as its own
    detection, an AVX-512 CPU gets SKYLAKEX, which this build has, and the ranks get it in their environment."""
    library = env.system_openblas()
    if library is None:
        pytest.skip("no system OpenBLAS")
    assert openblas.core_of(library, "PRESCOTT") == "Prescott"
    flags, vendor = openblas.cpu_flags_and_vendor()
    if openblas.isa_level(flags) < 2:
        pytest.skip("this CPU has no AVX-512")
    monkeypatch.delenv("OPENBLAS_CORETYPE", raising=False)
    real = openblas.core_of
    monkeypatch.setattr(openblas, "core_of", lambda lib, core: real(lib, core or "PRESCOTT"))
    description, extra = openblas.kernels_for(library)
    assert extra == {"OPENBLAS_CORETYPE": "SKYLAKEX"}
    assert description == "core SkylakeX (OPENBLAS_CORETYPE=SKYLAKEX: OpenBLAS's own detection chose Prescott)"


def test_a_users_coretype_wins_and_every_run_names_its_core(monkeypatch, tmp_path):
    """Whichever OpenBLAS `auto` preloads (the wheel or the system's: compare/machine/blas.py), its core is named;
    a cache folder of the test's own, so the cores come from this test's stand-in, not an earlier timing."""
    from compare.machine import blas

    library = env.system_openblas()
    if library is None:
        pytest.skip("no system OpenBLAS")
    monkeypatch.setattr(openblas, "core_of", lambda lib, core: {None: "Prescott", "HASWELL": "Haswell"}[core])
    monkeypatch.setenv("OPENBLAS_CORETYPE", "HASWELL")
    blas._choose.cache_clear()
    description, extra = env.mlx_blas("auto", tmp_path)
    assert "core Haswell (OPENBLAS_CORETYPE=HASWELL, yours)" in description
    assert "OPENBLAS_CORETYPE" not in extra  # the rank inherits the user's own
    monkeypatch.delenv("OPENBLAS_CORETYPE")
    monkeypatch.setattr(openblas, "core_of", lambda lib, core: "Cooperlake")
    blas._choose.cache_clear()
    assert "; core Cooperlake; measured sgemm" in env.mlx_blas("auto", tmp_path)[0]
    blas._choose.cache_clear()


def test_doctors_matmul_peak_runs_the_kernels_the_runs_get(monkeypatch, tmp_path):
    """The MFU denominator: measured_peaks starts MLX's probe with mlx_blas's environment, OPENBLAS_CORETYPE
    included, and keys its cache by the description that names the core."""
    import subprocess

    from compare.machine import peak

    chosen = ("openblas (lib, preloaded; core SkylakeX (OPENBLAS_CORETYPE=SKYLAKEX: ...))",
              {"LD_PRELOAD": "lib", "OPENBLAS_CORETYPE": "SKYLAKEX"})
    monkeypatch.setattr(env, "mlx_blas", lambda choice: chosen)
    monkeypatch.setattr(peak, "cache_path", lambda: tmp_path / "peak.json")
    seen, real_run = {}, subprocess.run

    def fake_run(argv, env=None, **kwargs):  # the framework probes only; anything else runs
        if len(argv) < 3 or not str(argv[2]).endswith("_impl.peak"):
            return real_run(argv, env=env, **kwargs)
        seen[argv[2]] = env
        return subprocess.CompletedProcess(argv, 0, stdout='{"flops": 1e9, "device": "cpu", "threads": 1}\n',
                                           stderr="")

    monkeypatch.setattr(peak.subprocess, "run", fake_run)
    peaks = peak.measured_peaks(refresh=True)
    assert seen["mlx_impl.peak"]["OPENBLAS_CORETYPE"] == "SKYLAKEX"
    assert peaks["mlx"]["blas"] == chosen[0]


def test_a_users_core_narrower_than_the_cpu_is_kept_and_named_as_such(monkeypatch):
    """The Zen 5's environment sets OPENBLAS_CORETYPE=Haswell on an AVX-512 CPU: kept, and the BLAS line says what
    the CPU allows; a user core as wide as the CPU gets no remark."""
    library = env.system_openblas()
    if library is None:
        pytest.skip("no system OpenBLAS")
    cores = {"HASWELL": "Haswell", "SKYLAKEX": "SkylakeX"}
    monkeypatch.setattr(openblas, "core_of", lambda lib, core: cores[core])
    monkeypatch.setattr(openblas, "cpu_flags_and_vendor", lambda: (AVX512, "AuthenticAMD"))
    monkeypatch.setenv("OPENBLAS_CORETYPE", "HASWELL")
    description, extra = openblas.kernels_for(library)
    assert description == ("core Haswell (OPENBLAS_CORETYPE=HASWELL, yours), narrower than this CPU's AVX-512: "
                           "unset it, or set SKYLAKEX") and extra == {}
    monkeypatch.setenv("OPENBLAS_CORETYPE", "SKYLAKEX")
    assert openblas.kernels_for(library) == ("core SkylakeX (OPENBLAS_CORETYPE=SKYLAKEX, yours)", {})
    monkeypatch.setattr(openblas, "cpu_flags_and_vendor", lambda: (AVX2, "AuthenticAMD"))
    monkeypatch.setenv("OPENBLAS_CORETYPE", "HASWELL")  # as wide as an AVX2 CPU allows
    assert openblas.kernels_for(library)[0] == "core Haswell (OPENBLAS_CORETYPE=HASWELL, yours)"
