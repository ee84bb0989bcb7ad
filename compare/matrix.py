"""`dpcompare compare`: every framework x strategy x dtype x world size on the same data, weights and
schedule, then a report.

Runs go one at a time so they never compete for cores. Every run's config and output directory are
checked before the first one starts; the token cache and the seed checkpoint are prepared once, and
every run reads the same files.
"""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

from common.config import DTYPES, FRAMEWORKS
from common.peers import ALIASES, PEERS, adapted, check_installed, peer_of
from common.config_sources import read_toml
from common.errors import ParityError, UserError
from common.parallel import MESH_STRATEGY, STRATEGIES
from common.parallel.mesh import Mesh

from .flags import config_from_args
from .plan import add_memory_predictions, add_predictions
from .report.labels import run_dirname, run_label, strategy_name
from .launch.linknotes import hf_gather_note
from .launch.folders import folder_warnings
from .machine.sharing import ring_polling_note
from .plan.model import memory_warning
from .report.restarts import restart_line
from .launch.hosts import check_hostfile
from .launch.runner import check_run_dir, launch, prepare_inputs
from .launch import slurm
from .launch.netns import check_can_emulate
from .submit import print_scripts, submit_options, submit_runs
from .machine.backends import check_available


def parse_list(text: str, name: str, kind=str, allowed=None) -> list:
    items = [item.strip() for item in str(text).split(",") if item.strip()]
    if not items:
        raise UserError(f"--{name} needs at least one value")
    try:
        values = [kind(item) for item in items]
    except ValueError:
        raise UserError(f"--{name} must be a comma list of {kind.__name__}s, got {text!r}") from None
    if allowed is not None:
        for value in values:
            if value not in allowed:
                raise UserError(f"unknown {name[:-1] if name.endswith('s') else name} {value!r}; allowed: "
                                f"{', '.join(allowed)}")
    if kind is int and any(v <= 0 for v in values):
        raise UserError(f"--{name} values must be positive, got {text!r}")
    return values


def run_matrix(args) -> int:
    if getattr(args, "recipe_from", None):  # your own two runs, reproduced and explained (compare/recipe_from.py)
        from .recipe_from import run_recipe_from
        return run_recipe_from(args, run_chain, check_run_dir_for_compare)
    if getattr(args, "recipes", None):
        return run_chain(args)  # --recipes A,B: A, B and the links between them, then the contributions table
    frameworks = parse_list(args.frameworks, "frameworks", allowed=(*FRAMEWORKS, *PEERS, *ALIASES))
    frameworks = [ALIASES.get(f, f) for f in frameworks]
    world_sizes = parse_list(args.nproc, "nproc", kind=int)
    toml = read_toml(args.config) if getattr(args, "config", None) else {}
    mesh = getattr(args, "mesh", None) or toml.get("mesh", "")
    strategies = parse_list(args.strategies or args.strategy or toml.get("strategy", "ddp"), "strategies",
                            allowed=STRATEGIES)
    if mesh:  # --mesh: one more cell per framework, at the mesh's rank count, judged against ddp x1
        strategies.append(MESH_STRATEGY)
    dtypes = parse_list(args.dtypes or args.dtype or toml.get("dtype", "float32"), "dtypes", allowed=DTYPES)
    submit = submit_options(args)  # --submit slurm: one sbatch job per run (compare/submit.py)
    # The backend flag names one framework's backend; `auto` lets each framework pick its own.
    first = getattr(peer_of(frameworks[0]), "framework", frameworks[0])  # a peer's config is its framework's
    base = config_from_args(args, framework=first, nproc=max(world_sizes), strategy="ddp", mesh="",
                            dtype="float32", launcher="slurm" if submit else None)
    out = Path(base.out or args.start_dir / "runs/compare")
    check_run_dir_for_compare(out, base.overwrite)
    configs, left_out = expand_matrix(base, frameworks, strategies, dtypes, world_sizes, out, mesh)
    for reason in left_out:
        print(f"dpcompare: note: {reason}", file=sys.stderr)
    if submit and submit.dry_run:
        return print_scripts(configs, submit)
    for cfg in configs.values() if not submit else ():
        slurm.check(cfg)  # inside an allocation: srun, and enough tasks for every run
    inputs = prepare_inputs(base)
    notes = [hf_gather_note(cfg, inputs.spec) for cfg in configs.values()]
    notes += [ring_polling_note(cfg) for cfg in configs.values()]
    notes += folder_warnings(base.init_from, base.cache_path)  # mlx-lm's and transformers' loaders on --init-from (launch/folders.py)
    notes += [f"{label}: {warning}" for (label, _), cfg in configs.items()  # warns, never refuses (plan/model.py)
              if (warning := memory_warning(cfg, inputs.spec))]
    for note in dict.fromkeys(filter(None, notes)):  # each once: the ring's is the same for every MLX run of a size
        print(f"dpcompare: note: {note}", file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    if submit:
        try:
            run_dirs, failed = submit_runs(configs, submit)
        except KeyboardInterrupt as stop:
            raise matrix_interrupted(stop, stop.run_dirs, out, args, [])
    else:
        run_dirs, failed = run_here(configs, inputs, out, args)
    command = "dpcompare " + shlex.join(sys.argv[1:]) if sys.argv else ""
    # A failed cross-framework verdict is followed by a diagnosis: where the frameworks first part.
    diagnose_failures(run_dirs, out, tolerances_from_args(args))
    write_samples(run_dirs, args)
    # the cost model's step for every N > 1 run, from its N=1 run (compare/plan/predictions.py)
    add_predictions(run_dirs)
    add_memory_predictions(run_dirs)  # and every run's peak memory per rank from the shapes
    return finish(run_dirs, out, args, {"command": command}, failed)


def run_chain(args) -> int:
    """`--recipes A,B` (compare/chain.py): every link of the chain from recipe A to B, in each framework and world
    size named, at one strategy and dtype; then A's report in --out with the contributions table, B's beside it."""
    from .chain import chain_links, describe, link_dirname, link_label, out_of, parse_recipes
    from .report.contributions import contributions, write_chain_figure

    names = parse_recipes(args.recipes, args)
    if args.strategies or args.dtypes or getattr(args, "mesh", None) or submit_options(args):
        raise UserError("--recipes runs one strategy and dtype here (--strategy, --dtype), without --mesh or "
                        "--submit")
    frameworks = parse_list(args.frameworks, "frameworks", allowed=FRAMEWORKS)
    world_sizes = parse_list(args.nproc, "nproc", kind=int)
    links, chain = chain_links(args, names, framework=frameworks[0], nproc=max(world_sizes), mesh="")
    out = out_of(chain[0], args)
    check_run_dir_for_compare(out, chain[0].overwrite)
    configs, series, ends = {}, {}, []
    for k, link_cfg in enumerate(chain):
        cells, _ = expand_matrix(link_cfg, frameworks, [link_cfg.strategy], [link_cfg.dtype], world_sizes,
                                 out / "links" / link_dirname(k, links, names))
        ends.append([run_dir for _, run_dir in cells])
        for (label, run_dir), cfg in cells.items():
            configs[(f"{label} [{link_label(k, links, names)}]", run_dir)] = cfg
            series.setdefault(label, []).append(run_dir)
    print(f"dpcompare: {describe(links, names)}", file=sys.stderr)
    inputs = prepare_inputs(chain[0])
    out.mkdir(parents=True, exist_ok=True)
    _, failed = run_here(configs, inputs, out, args)
    table = {**contributions(names, links, series), "b_report": str(ends[-1][0].parent / "report.md")}
    table["plot"] = write_chain_figure(table, series, out)
    diagnose_failures(ends[0], out, tolerances_from_args(args))  # recipe A's report is a compare's, whole
    write_samples(ends[0], args)
    add_predictions(ends[0])
    add_memory_predictions(ends[0])
    command = "dpcompare " + shlex.join(sys.argv[1:]) if sys.argv else ""
    finish(ends[-1], ends[-1][0].parent, args, {"command": command}, [], quiet=True)  # B's own report
    return finish(ends[0], out, args, {"command": command, "contributions": table}, failed)


def run_here(configs: dict, inputs, out: Path, args) -> tuple[list[Path], list[tuple[str, str]]]:
    """Every run, one after another, from this process: (run directories, [(label, error)] of failed runs)."""
    run_dirs, failed = [], []
    for (label, run_dir), cfg in configs.items():
        where = cfg.resolved_backend if cfg.world_size > 1 else "single process"
        print(f"== {label} ({where}) -> {run_dir}", file=sys.stderr, flush=True)
        try:
            summary = launch(cfg, inputs, run_dir)
        except UserError as err:
            summary = {"status": "failed", "error": str(err)}
        except KeyboardInterrupt as stop:  # a signal stops the whole matrix: no further run starts
            raise matrix_interrupted(stop, run_dirs, out, args, failed)
        for record in summary.get("restarts") or []:  # --max-restarts: one line each (compare/report/restarts.py)
            print(f"   {restart_line(record, cfg.max_restarts)}", file=sys.stderr, flush=True)
        if summary["status"] != "ok":
            failed.append((label, summary.get("error")))
            print(f"   failed: {summary.get('error')}", file=sys.stderr, flush=True)
        run_dirs.append(run_dir)
    return run_dirs, failed


def expand_matrix(base, frameworks, strategies, dtypes, world_sizes, out: Path,
                  mesh: str = "") -> tuple[dict, list[str]]:
    """{(label, run_dir): RunConfig} for every run, each validated and its directory, hostfile, backend and
    device checked now, before anything is prepared or trains; and the combinations left out, with the
    reason (fsdp and tp need 2 ranks or more; a mesh runs at its own rank count)."""
    configs, left_out = {}, []
    grid = Mesh.parse(mesh) if mesh else None
    # `--strategies pp --nproc 1,2`: the 1 asks for the reference every strategy is judged against, ddp x1,
    # which is run first even though ddp is not listed (once something at 2 or more ranks is left to judge).
    reference = "ddp" not in strategies and 1 in world_sizes
    for strategy in (["ddp"] if reference else []) + list(strategies):
        cell_mesh = grid.text if grid and strategy == MESH_STRATEGY else ""
        name = strategy_name(strategy, cell_mesh)
        for dtype in dtypes:
            for fw in frameworks:
                for n in world_sizes:
                    if reference and strategy == "ddp" and n != 1:
                        continue
                    if strategy != "ddp" and n == 1:
                        left_out.append(f"{run_label(fw, n, name, dtype)} left out: {name} needs 2 or "
                                        "more ranks (its reference is the ddp run)")
                        continue
                    if grid and cell_mesh and n != grid.size:
                        left_out.append(f"{run_label(fw, n, name, dtype)} left out: --mesh {grid.text} runs on "
                                        f"{grid.size} ranks")
                        continue
                    run_dir = out / run_dirname(fw, n, name, dtype)
                    peer = peer_of(fw)  # mlx-lm, hf: a peer's own trainer on its framework (common/peers.py)
                    cfg = base.replace(framework=peer.framework if peer else fw, nproc=n, strategy=strategy,
                                       mesh=cell_mesh, dtype=dtype, out=str(run_dir),
                                       backend=base.backend if fw == frameworks[0] else "auto")
                    if peer:
                        check_installed(peer.name)
                        cfg, lines = adapted(peer.name, cfg)  # what it cannot be told, set to its own, in a line
                        left_out.extend(lines)
                    check_run_dir(run_dir, cfg.resume, cfg.overwrite)
                    # A backend or device this machine lacks is refused now, not as a failed run halfway through
                    check_hostfile(cfg)
                    check_available(cfg)
                    if cfg.link and cfg.world_size > 1:
                        check_can_emulate(cfg.link)
                    configs[(run_label(fw, n, name, dtype), run_dir)] = cfg
    if reference:
        added = [label for (label, _), cfg in configs.items() if cfg.strategy == "ddp"]
        if len(added) == len(configs):  # nothing at 2 or more ranks to judge against it
            configs = {}
        else:
            left_out.append(f"{', '.join(added)} added: the reference the other runs are judged against")
    if not configs:
        raise UserError("nothing to run: " + "; ".join(left_out))
    return configs, left_out


def matrix_interrupted(stop: KeyboardInterrupt, run_dirs: list[Path], out: Path, args, failed: list):
    """No report from a half-finished matrix unless asked (--report-on-interrupt): its verdicts would
    silently lack runs. `dpcompare report` still builds one from whatever finished."""
    if getattr(args, "report_on_interrupt", False) and run_dirs:
        write_samples(run_dirs, args)
        finish(run_dirs, out, args, {"command": "dpcompare " + shlex.join(sys.argv[1:])}, failed)
    stop.detail = (f"{getattr(stop, 'detail', None) or 'interrupted'}; the comparison stopped there "
                   f"(dpcompare report {out} reports the runs that finished)")
    return stop


def check_run_dir_for_compare(out: Path, overwrite: bool) -> None:
    if (out / "run_config.json").exists():
        raise UserError(f"{out} is a run directory: a comparison writes its runs and report into --out; "
                        "choose another --out")
    if (out / "summary.json").exists() and not overwrite:
        raise UserError(f"{out} already holds a comparison; pass --overwrite or choose another --out")
    if out.exists() and not out.is_dir():
        raise UserError(f"output path {out} exists and is not a directory")
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / ".write_probe").write_text("")
        (out / ".write_probe").unlink()
        if created:  # made again once every run is checked: a refused compare leaves nothing behind
            out.rmdir()
    except OSError as err:
        raise UserError(f"cannot write to output directory {out}: {err.strerror}") from None


def diagnose_failures(run_dirs: list[Path], out: Path, tol) -> None:
    """`dpcompare diagnose` for every cross-framework pair whose per-step check failed, its finding written
    where the report reads it (compare/report/diagnoses.py); a pair that passes loses an older finding."""
    from common.metrics import write_json

    from .diagnose import diagnose_pair, finding
    from .report.diagnoses import FINDING_FILE, diagnosis_dir, failed_cross_framework_pairs
    from .report.parity import judge, load_run

    parity = judge([load_run(Path(d)) for d in run_dirs], tol)
    failed = failed_cross_framework_pairs(parity)
    for pair in parity["cross_framework"]:
        if pair not in failed:
            (diagnosis_dir(out, pair) / FINDING_FILE).unlink(missing_ok=True)
    for pair in failed:
        where = diagnosis_dir(out, pair)
        try:
            result = diagnose_pair(pair, where)
            found = {"finding": finding(result), "first_divergence": result.get("first_divergence"),
                     "file": str(where / "diagnosis.json")}
        except Exception as err:  # noqa: BLE001 - a failed diagnosis must not cost the report
            found = {"finding": f"diagnosis failed: {err}", "first_divergence": None}
        where.mkdir(parents=True, exist_ok=True)
        write_json(where / FINDING_FILE, found)


def write_samples(run_dirs: list[Path], args=None) -> None:
    """A greedy continuation from each finished run's final weights, into its sample.json for the report;
    none with --no-samples (the report then has no continuations section)."""
    if getattr(args, "no_samples", False):
        return
    from .launch.sample import write_samples as sample_runs
    from .report.parity import load_run

    # a peer's run keeps its adapters in its own trainer's files, not a checkpoint of ours: no continuation
    sample_runs([d for d in run_dirs if (run := load_run(Path(d))).ok and not run.peer_of])


def finish(run_dirs: list[Path], out: Path, args, context: dict, failed: list, quiet: bool = False) -> int:
    """Baselines (--against, --save-baseline), the report, its terminal table, and the exit code; quiet: the
    report alone (a chain's recipe B, compare --recipes)."""
    from .report.baseline import apply_baseline_flags, baseline_failed
    from .report.writer import terminal_table, write_report

    tol = tolerances_from_args(args)
    if quiet:
        write_report(run_dirs, out, tol, context)
        return 0
    baseline = apply_baseline_flags(args, run_dirs, tol)
    summary = write_report(run_dirs, out, tol, {**context, "baseline": baseline})
    print(terminal_table(summary, verbose=getattr(args, "verbose", False)))
    print(f"\nreport: {out / 'report.html'}  ({out / 'report.md'}, {out / 'summary.json'})")
    if failed:
        for label, error in failed:
            print(f"dpcompare: error: {label} failed: {error}", file=sys.stderr)
        return 1
    if getattr(args, "strict", False) and not summary.get("verdicts", {}).get("all_pass", True):
        raise ParityError("a parity verdict failed (--strict); see the report")
    if getattr(args, "strict", False) and baseline_failed(baseline):
        raise ParityError(f"a run departs from its baseline {args.against} (--strict); see the report")
    return 0


def tolerances_from_args(args):
    from .report.parity import Tolerances

    tol = Tolerances()
    for name, field in (("loss_atol", "loss_atol"), ("parity_steps", "parity_steps"), ("curve_rtol", "curve_rtol")):
        value = getattr(args, name, None)
        if value is not None:
            if value <= 0:
                raise UserError(f"--{name.replace('_', '-')} must be positive, got {value}")
            setattr(tol, field, value)
    return tol


def rebuild_report(args) -> int:
    """`dpcompare report`: the report of existing runs, from their files alone (samples and diagnoses
    included where `dpcompare compare` wrote them; nothing is trained, sampled or diagnosed)."""
    run_dirs: list[Path] = []
    for given in map(Path, args.runs):
        if (given / "run_config.json").exists():
            run_dirs.append(given)
        elif given.is_dir() and any(p.joinpath("run_config.json").exists() for p in given.iterdir() if p.is_dir()):
            run_dirs += sorted(p for p in given.iterdir() if (p / "run_config.json").exists())
        else:
            raise UserError(f"{given} is neither a run directory nor a directory of runs")
    if args.out:
        out = Path(args.out)
    elif len(args.runs) == 1:  # a compare directory holds its report; a single run gets a report/ inside
        given = Path(args.runs[0])
        out = given / "report" if (given / "run_config.json").exists() else given
    else:
        out = args.start_dir / "runs/report"
    out.mkdir(parents=True, exist_ok=True)
    return finish(run_dirs, out, args, {"command": "dpcompare " + shlex.join(sys.argv[1:])}, failed=[])
