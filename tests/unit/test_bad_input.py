"""Bad input: exit code 2, one line that names the problem, no traceback, nothing written or overwritten."""
import os
import shutil
import stat
import sys

from common.model.spec import ModelSpec
from common.model.weights import init_weights, save_pretrained
from helpers import FAST, dpcompare_here


def _cases(tmp):
    missing = tmp / "nope.txt"
    empty = tmp / "empty.txt"
    empty.write_text("\n\n")
    tiny = tmp / "tiny.txt"
    tiny.write_text("One short story.\n\nAnother one.\n")
    bad_toml = tmp / "bad.toml"
    bad_toml.write_text("steps = = 1\n")
    unknown_toml = tmp / "unknown.toml"
    unknown_toml.write_text("stepz = 1\n")
    bad_hostfile = tmp / "hosts.json"
    bad_hostfile.write_text("{not json")
    bad_tok = tmp / "tokenizer.json"
    bad_tok.write_text("{}")
    seed = tmp / "seed"
    other = ModelSpec(vocab_size=512, dim=32, n_layers=1, n_heads=4, n_kv_heads=4, ffn_dim=64)
    save_pretrained(seed, other, init_weights(other, 0))
    readonly = tmp / "readonly"
    readonly.mkdir()
    readonly.chmod(stat.S_IRUSR | stat.S_IXUSR)
    run = ["run", "--framework", "mlx", *FAST, "--steps", "2"]
    return [
        ("unknown preset", [*run, "--preset", "huge"], "unknown preset 'huge'"),
        ("unknown framework", ["run", "--framework", "jax", *FAST], "unknown framework 'jax'"),
        ("unknown backend", [*run, "--backend", "carrier-pigeon"], "unknown backend 'carrier-pigeon'"),
        ("torch backend for mlx", [*run, "--backend", "gloo"], "unknown backend 'gloo' for framework mlx"),
        ("unknown field via --set", [*run, "--set", "stepz=3"], "unknown config field 'stepz'"),
        ("unknown model field", [*run, "--set", "model.dimm=3"], "unknown model field 'dimm'"),
        ("zero steps", [*run, "--steps", "0"], "steps must be positive"),
        ("doctor with no calls", ["doctor", "--fabric", "--max-calls", "0"], "a positive --max-mb, --time-budget-s and --max-calls"),
        ("negative batch", [*run, "--global-batch-size", "-8"], "global_batch_size must be positive"),
        ("negative lr", [*run, "--lr", "-0.1"], "lr must be positive"),
        ("nproc zero", [*run, "--nproc", "0"], "nproc must be positive"),
        ("batch not divisible", [*run, "--nproc", "2", "--grad-accum", "3"], "not divisible by world size 2 x grad accum 3"),
        ("seq_len above max", [*run, "--seq-len", "4096"], "exceeds the model's max_seq_len 512"),
        ("dataset path missing", [*run, "--dataset", str(missing)], "does not exist"),
        ("empty dataset", [*run, "--dataset", str(empty)], "empty"),
        ("dataset smaller than a batch", [*run, "--dataset", str(tiny), "--sequence", "padding"], "fewer than one global batch"),
        ("tokenizer cannot be loaded", [*run, "--tokenizer", str(bad_tok)], "tokenizer"),
        ("tokenizer dir missing", [*run, "--tokenizer", str(tmp / "no-such-tokenizer-dir/")], "tokenizer"),
        ("vocab larger than the model's", [*run, "--set", "model.vocab_size=100"], "more than the model's vocab_size 100"),
        ("seed checkpoint of another shape", [*run, "--init-from", str(seed)], "init-from"),
        ("malformed TOML", [*run, "--config", str(bad_toml)], "not valid TOML"),
        ("unknown TOML key", [*run, "--config", str(unknown_toml)], "unknown config field 'stepz'"),
        ("missing config file", [*run, "--config", str(tmp / "nope.toml")], "does not exist"),
        ("hostfile that does not parse", [*run, "--nproc", "2", "--hostfile", str(bad_hostfile)], "hostfile"),
        ("missing hostfile", [*run, "--nproc", "2", "--hostfile", str(tmp / "hosts-missing.json")], "hostfile"),
        ("unwritable output directory", [*run, "--out", str(readonly / "run")], "cannot be"),
        ("wrong type", [*run, "--set", "steps=many"], "steps must be int"),
        ("unknown sequence mode", [*run, "--sequence", "chunks"], "unknown sequence 'chunks'"),
        ("unknown mlx blas", [*run, "--mlx-blas", "mkl"], "unknown mlx_blas 'mkl'"),
        *([("mps where torch has none", ["run", "--framework", "torch", *FAST, "--device", "mps", "--nproc", "2"],
            "sees no mps device")] if sys.platform != "darwin" else []),
        ("jaccl without a hostfile", [*run, "--nproc", "2", "--backend", "jaccl"], "needs --hostfile"),
        ("unknown dtype", [*run, "--dtype", "float16"], "unknown dtype 'float16'"),
        ("unknown strategy", [*run, "--strategy", "zero"], "unknown strategy 'zero'"),
        ("fsdp on one rank", [*run, "--strategy", "fsdp"], "needs 2 or more"),
        ("fsdp block that does not shard", [*run, "--strategy", "fsdp", "--nproc", "2", "--set", "model.ffn_dim=175"],
         "cannot shard model.layers.0.mlp.gate_proj.weight of shape (175, 64) over 2 ranks"),
        ("torch pipeline with fewer micro-batches than stages",
         ["run", "--framework", "torch", *FAST, "--strategy", "pp", "--nproc", "2", "--pp-microbatches", "1"],
         "--pp-microbatches 1 is fewer than the 2 pipeline stages"),
        ("compare unknown framework", ["compare", "--frameworks", "mlx,jax", *FAST], "unknown framework 'jax'"),
        ("compare nproc zero", ["compare", "--nproc", "0,1", *FAST], "positive"),
        ("report of a missing directory", ["report", str(tmp / "no-runs")], "does not exist"),
        ("report of a directory without runs", ["report", str(readonly)], "neither a run directory"),
        ("export without checkpoint", ["export", str(tmp), "--out", str(tmp / "exp")], "no checkpoint"),
        ("unknown subcommand flag", [*run, "--stepz", "3"], "unrecognized arguments"),
        ("link with one rank", [*run, "--link", "1gbit"], "--nproc 1 has none"),
        ("link rate without a unit", [*run, "--nproc", "2", "--link", "100"], "give a rate such as 200mbit"),
        ("emulated link between hosts", [*run, "--nproc", "2", "--link", "1gbit", "--hostfile", str(bad_hostfile)],
         "cannot be combined with --hostfile"),
        ("emulated link for nccl", ["run", "--framework", "torch", *FAST, "--nproc", "2", "--link", "1gbit",
                                    "--backend", "nccl"], "emulated links work with gloo"),
    ]


def test_every_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, cache_dir):
    if os.geteuid() == 0:
        pass  # root ignores directory permissions; the unwritable case uses a file path instead below
    out = tmp_path / "out"
    failures = []
    for name, args, needle in _cases(tmp_path):
        if name == "unwritable output directory" and os.geteuid() == 0:
            blocker = tmp_path / "a-file"
            blocker.write_text("user data")
            args = [*args[:-1], str(blocker / "run")]
        if "--out" not in args and args[0] in ("run", "compare"):
            args = [*args, "--out", str(out)]
        proc = dpcompare_here(*args, cache_dir=cache_dir)  # none of these gets as far as a rank
        lines = proc.stderr.strip().splitlines()
        problems = []
        if proc.returncode != 2:
            problems.append(f"exit {proc.returncode}")
        if len(lines) != 1 or "Traceback" in proc.stderr:
            problems.append(f"stderr has {len(lines)} lines")
        if needle.lower() not in proc.stderr.lower():
            problems.append(f"message lacks {needle!r}")
        if out.exists() and any(out.iterdir()):
            problems.append("wrote into --out")
            shutil.rmtree(out)
        if problems:
            failures.append(f"{name}: {', '.join(problems)}: {proc.stderr.strip()[-400:]}")
    assert not failures, "\n".join(failures)
