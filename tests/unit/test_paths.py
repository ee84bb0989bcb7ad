"""Every path a user gives is resolved once: flags and positional arguments against the directory dpcompare
was started in, paths inside a TOML config against the config's directory. Bad paths are one line naming
the path as typed and as resolved. Nothing here trains: the parser and the resolver are called directly."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from common.config import read_toml
from common.errors import UserError
from common.paths import CONFIG_PATHS, resolve
from compare.cli import build_parser
from compare.flags import BUILTIN_CONFIGS, config_from_args, resolve_paths
from helpers import ROOT

# Every path-valued flag and positional argument of every command: (command, argv before the value, dest,
# kind of thing to create). The first test checks this list against what the parsers declare.
PATH_ARGS = [
    *[(cmd, [flag], dest, kind) for cmd in ("run", "compare", "diagnose") for dest, flag, kind in (
        ("config", "--config", "config"), ("out", "--out", "new"), ("dataset", "--dataset", "dataset"),
        ("tokenizer", "--tokenizer", "tokenizer"), ("init_from", "--init-from", "dir"),
        ("hostfile", "--hostfile", "file"), ("cache_dir", "--cache-dir", "new"))],
    ("compare", ["--against"], "against", "file"), ("compare", ["--save-baseline"], "save_baseline", "new"),
    ("diagnose", ["--from"], "from_run", "dir"),
    ("prepare", ["--config"], "config", "config"), ("prepare", ["--dataset"], "dataset", "dataset"),
    ("prepare", ["--tokenizer"], "tokenizer", "tokenizer"), ("prepare", ["--out"], "cache_dir", "new"),
    ("report", [], "runs", "dir"), ("report", ["runs-a", "--out"], "out", "new"),
    ("report", ["runs-a", "--against"], "against", "file"),
    ("report", ["runs-a", "--save-baseline"], "save_baseline", "new"),
    ("export", [], "run_dir", "dir"), ("export", ["runs-a", "--out"], "out", "new"),
    ("batches", [], "run_dir", "dir"), ("batches", ["runs-a", "--steps", "0:1", "--out"], "out", "new"),
    ("plan", ["--from"], "from_run", "dir"), ("plan", ["--from", "runs-a", "--fabric"], "fabric", "file"),
    ("plan", ["--from", "runs-a", "--fabric-inner"], "fabric_inner", "file"),
    ("plan", ["--from", "runs-a", "--out"], "out", "new"), ("plan", ["--from", "runs-a", "--fit"], "fit", "dir"),
    ("doctor", ["--hostfile"], "hostfile", "file"), ("doctor", ["--out"], "out", "new"),
]
MINIMAL = {"export": ["--out", "exported"], "plan": ["--from", "runs-a"], "report": ["runs-a"],
           "batches": ["--steps", "0:1", "--out", "b.npz"]}
RELATIVE = {"config": "cfg/run.toml", "dataset": "data/train.txt", "tokenizer": "tok/tokenizer.json",
            "dir": "inputs/folder", "file": "inputs/hosts.json", "new": "out/new"}


def make(start: Path, kind: str) -> str:
    """The thing a flag of this kind names, created under `start`; returns its relative spelling."""
    rel = RELATIVE[kind]
    path = start / rel
    if kind == "dir":
        path.mkdir(parents=True, exist_ok=True)
    elif kind != "new":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("steps = 3\n" if kind == "config" else "{}")
    return rel


def parsed(start: Path, argv: list[str]):
    (start / "runs-a").mkdir(exist_ok=True)
    args = build_parser().parse_args(argv)
    resolve_paths(args, start)
    return args


def test_the_table_names_every_path_argument_the_parsers_declare():
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    declared = {(cmd, dest) for cmd, sub in commands.items() for dest in sub.get_default("paths") or {}}
    assert declared == {(cmd, dest) for cmd, _, dest, _ in PATH_ARGS}


@pytest.mark.parametrize("command,before,dest,kind", PATH_ARGS,
                         ids=[f"{c}-{d}-{' '.join(b)}" for c, b, d, _ in PATH_ARGS])
def test_every_path_argument_resolves_against_the_start_directory(tmp_path, command, before, dest, kind):
    start = tmp_path / "elsewhere"  # not the working directory of this process
    start.mkdir()
    rel = make(start, kind)
    argv = [command, *before, rel]
    if not before or before[-1] not in MINIMAL.get(command, []):
        argv += [a for a in MINIMAL.get(command, []) if a not in before]
    args = parsed(start, argv)
    value = getattr(args, dest)
    expected = str(start / rel)
    assert (value[0] if isinstance(value, list) else value) == expected
    assert args.start_dir == start


@pytest.mark.parametrize("key", sorted(CONFIG_PATHS))
def test_set_paths_resolve_against_the_start_directory(tmp_path, key):
    kind = {"dataset": "dataset", "tokenizer": "tokenizer", "init_from": "dir", "hostfile": "file"}.get(key, "new")
    rel = make(tmp_path, kind)
    args = parsed(tmp_path, ["run", "--set", f"{key}={rel}", "--set", "steps=3"])
    assert args.set == [f"{key}={tmp_path / rel}", "steps=3"]


@pytest.mark.parametrize("key", sorted(CONFIG_PATHS))
def test_toml_paths_resolve_against_the_config_files_directory(tmp_path, key):
    configs = tmp_path / "configs"
    configs.mkdir()
    kind = {"dataset": "dataset", "tokenizer": "tokenizer", "init_from": "dir", "hostfile": "file"}.get(key, "new")
    rel = make(configs, kind)
    (configs / "run.toml").write_text(f'{key} = "{rel}"\nsteps = 3\n')
    assert read_toml(str(configs / "run.toml"))[key] == str(configs / rel)


def test_a_config_built_from_relative_flags_and_toml_holds_only_absolute_paths(tmp_path):
    start, configs = tmp_path / "work", tmp_path / "work" / "configs"
    (configs / "data").mkdir(parents=True)
    (configs / "data" / "train.txt").write_text("A story.\n\nAnother story.\n")
    (configs / "run.toml").write_text('dataset = "data/train.txt"\ncache_dir = "../cache"\nsteps = 3\n')
    args = parsed(start, ["run", "--config", "configs/run.toml", "--out", "myrun", "--framework", "torch"])
    cfg = config_from_args(args)
    assert (cfg.dataset, cfg.cache_dir, cfg.out) == (str(configs / "data" / "train.txt"), str(start / "cache"),
                                                     str(start / "myrun"))


def test_builtin_and_hub_names_are_left_alone_and_local_names_win(tmp_path):
    assert resolve("builtin", tmp_path, "dataset", "--dataset") == "builtin"
    assert resolve("roneneldan/TinyStories", tmp_path, "dataset", "--dataset") == "roneneldan/TinyStories"
    assert resolve("gpt2", tmp_path, "tokenizer", "--tokenizer") == "gpt2"
    (tmp_path / "gpt2").mkdir()  # a folder of that name where dpcompare started: the local one, as sources.py reads it
    assert resolve("gpt2", tmp_path, "tokenizer", "--tokenizer") == str(tmp_path / "gpt2")
    assert resolve("~/x.txt", tmp_path, "out_file", "--out").startswith(str(Path.home()))


@pytest.mark.parametrize("argv,typed,problem", [
    (["run", "--hostfile", "hosts.json"], "hosts.json", "does not exist"),
    (["run", "--dataset", "./missing.txt"], "./missing.txt", "does not exist"),  # a path, not a hub name
    (["run", "--tokenizer", "tok/tokenizer.json"], "tok/tokenizer.json", "does not exist"),
    (["run", "--init-from", "a-file"], "a-file", "is a file, not a directory"),
    (["run", "--out", "a-file"], "a-file", "is a file, not a directory"),
    (["compare", "--out", "a-file/run"], "a-file/run", "cannot be created"),
    (["run", "--config", "missing.toml"], "missing.toml", "does not exist"),
    (["report", "nowhere"], "nowhere", "does not exist"),
    (["export", "a-file", "--out", "x"], "a-file", "is a file, not a directory"),
    (["plan", "--from", "runs-a", "--fabric", "."], ".", "is a directory, not a file"),
])
def test_a_bad_path_is_one_line_naming_it_as_typed_and_as_resolved(tmp_path, argv, typed, problem):
    (tmp_path / "a-file").write_text("user data")
    with pytest.raises(UserError) as err:
        parsed(tmp_path, argv)
    message = str(err.value)
    assert "\n" not in message and problem in message
    assert f"{typed} (resolved: {os.path.normpath(tmp_path / typed)})" in message
    assert (tmp_path / "a-file").read_text() == "user data"


def test_a_bad_path_inside_a_toml_names_the_config_file(tmp_path):
    (tmp_path / "run.toml").write_text('hostfile = "hosts.json"\n')
    with pytest.raises(UserError, match=rf"hostfile in .*run\.toml hosts\.json \(resolved: {tmp_path}/hosts\.json\) "
                                        "does not exist"):
        read_toml(str(tmp_path / "run.toml"))


def test_a_missing_config_lists_the_builtin_ones_and_a_builtin_name_needs_no_path(tmp_path):
    with pytest.raises(UserError, match="built-in configs: demo"):
        parsed(tmp_path, ["run", "--config", "nope"])
    args = parsed(tmp_path, ["compare", "--config", "demo"])
    assert args.config == str(BUILTIN_CONFIGS / "demo.toml")
    assert read_toml(args.config)["dataset"] == "builtin"
    (tmp_path / "demo").write_text("steps = 3\n")  # a file of that name where dpcompare started wins
    assert parsed(tmp_path, ["run", "--config", "demo"]).config == str(tmp_path / "demo")


def refused_as_nobody(path: Path, kind: str) -> str:
    """resolve() in a process without root's rights over `path` (root reads everything): its error."""
    if os.geteuid() != 0:
        try:
            resolve(str(path), path.parent, kind, "--x")
        except UserError as err:
            return str(err)
        return "accepted"
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        os.close(read)
        try:
            os.setgid(65534)
            os.setuid(65534)
            resolve(str(path), path.parent, kind, "--x")
            message = "accepted"
        except BaseException as err:  # noqa: BLE001 - reported to the parent
            message = str(err)
        os.write(write, message.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        message = pipe.read()
    os.waitpid(pid, 0)
    return message


def first_closed_on_the_way(path: Path) -> Path:
    """The first directory on the way to `path` that the checking user cannot enter: `nobody` where the test
    runs as root (it has only the "other" bits), the owner otherwise. On macOS every user's TMPDIR is private
    (0700), so as root the first closed directory may be one of TMPDIR's parents, not the test's own."""
    bit = 0o001 if os.geteuid() == 0 else 0o100
    return next(p for p in [*reversed(path.parents), path] if not p.stat().st_mode & bit)


def test_an_unreadable_input_is_refused():
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        base.chmod(0o755)  # reachable by the unprivileged user, where TMPDIR's parents let it
        secret = base / "hosts.json"
        secret.write_text("{}")
        secret.chmod(0)
        closed = base / "closed"
        (closed / "inner").mkdir(parents=True)
        closed.chmod(0)  # closed to its owner too, so the check holds without root
        try:
            assert "cannot be read" in refused_as_nobody(secret, "file")
            blocked = first_closed_on_the_way(closed)
            assert f"cannot be read: {blocked} is not accessible" in refused_as_nobody(closed / "inner", "dir")
        finally:
            closed.chmod(0o700)  # so that the folder can be removed


def test_another_package_named_common_earlier_on_the_path_does_not_replace_ours(tmp_path):
    """dpcompare's packages have plain names: a user's `common` on PYTHONPATH (ahead of ours) must not be
    imported by the CLI, nor by the processes it starts (their PYTHONPATH starts with our directory)."""
    (tmp_path / "common").mkdir()
    (tmp_path / "common" / "__init__.py").write_text("SOMEONE_ELSES = True\n")
    code = ("import compare.cli, common, common.config; from compare.machine.environment import child_env; "
            "print(common.__file__); print(child_env()['PYTHONPATH'].split(':')[0])")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    imported, child_first = proc.stdout.split()
    assert imported == str(ROOT / "common" / "__init__.py") and child_first == str(ROOT)
