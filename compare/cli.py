"""`dpcompare`: one CLI for preparing data, running one backend, comparing both, and reporting.

User mistakes (common.errors.UserError) become one line on stderr and exit code 2; a failed run exits 1;
a failed parity verdict under --strict exits 3. SIGINT, SIGTERM or SIGHUP stops the job, marks the run
interrupted and exits 128 + the signal number (130, 143, 129).
"""
from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from pathlib import Path

from common.config import RunConfig
from common.config_sources import read_toml
from common.errors import ParityError, UserError

from . import __version__
from .flags import (BASELINE_PATHS, RUN_PATHS, add_baseline_flags, add_run_flags, add_tolerance_flags,
                    config_from_args, resolve_paths)
from . import import_run
from .submit import add_submit_flags
from .launch.watchdog import install_stop_handlers, restore_handlers


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # SIGTERM (kill, timeout, CI, systemd) and SIGHUP (a closed ssh session) stop a job like Ctrl-C does.
    previous = install_stop_handlers()
    try:
        # Once, here: every path is absolute from now on, whatever directory a child process runs in.
        resolve_paths(args, Path.cwd())
        if str(getattr(args, "recipe", "") or "").endswith(".json"):  # a recipe file: the ranks start elsewhere
            args.recipe = str((args.start_dir / args.recipe).resolve())
        return args.handler(args)
    except (UserError, ParityError) as err:
        print(f"dpcompare: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt as err:
        signum = getattr(err, "signum", signal.SIGINT)
        with contextlib.suppress(OSError):  # after SIGHUP the terminal may be gone
            print(f"dpcompare: {getattr(err, 'detail', None) or 'interrupted'}", file=sys.stderr)
        return 128 + signum  # what a shell reports for a process killed by that signal
    finally:
        restore_handlers(previous)


VERBOSE_HELP = ("print every speed ratio (each strategy vs ddp, bf16 vs fp32) and the scaling and memory tables "
                "by run group after the verdict; the report always holds them")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own exit code is 2 too; keep its message to one line
        self.exit(2, f"dpcompare: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dpcompare", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"dpcompare {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    doctor = sub.add_parser("doctor", help="what this machine can run: frameworks, devices, backends, BLAS")
    doctor.add_argument("--peak", action="store_true", help="also measure each framework's matmul peak")
    doctor.add_argument("--fabric", action="store_true",
                        help="measure all-reduce latency and bandwidth of every usable backend (2 local ranks, "
                             "or the hosts of --hostfile) and estimate a step's gradient sync")
    doctor.add_argument("--hostfile", help="--fabric across these hosts: an MLX JSON hostfile (mlx.launch, ssh)")
    doctor.add_argument("--backend", help="--fabric: only these backends, a comma list (ring, mpi, gloo, nccl, "
                                          "mlx:nccl, ...); with --hostfile: jaccl, jaccl-ring or ring")
    doctor.add_argument("--nproc", type=int, default=2, help="--fabric: local ranks (default 2)")
    doctor.add_argument("--link", help="--fabric: the local ranks talk over an emulated link of this rate "
                                       "(200mbit, 1gbit, ...; root, Linux)")
    doctor.add_argument("--max-mb", type=float, default=32.0, help="--fabric: largest message, MB (default 32)")
    doctor.add_argument("--time-budget-s", type=float, default=55.0,
                        help="--fabric: the whole measurement's time limit (default 55)")
    doctor.add_argument("--max-calls", type=int, default=20,
                        help="--fabric: timed calls per message size at most (default 20; fewer is quicker)")
    doctor.add_argument("--preset", default="small", help="--fabric: the model whose gradient sync is estimated")
    doctor.add_argument("--seq-len", type=int, default=128, help="--fabric: tokens per sequence of that step")
    doctor.add_argument("--global-batch-size", type=int, default=8, help="--fabric: sequences per step")
    doctor.add_argument("--out", help="--fabric: also write the figures as JSON to this file, for `dpcompare plan "
                                      "--fabric FILE`")
    doctor.set_defaults(handler=cmd_doctor, paths={"hostfile": ("--hostfile", "file"), "out": ("--out", "out_file")})

    prepare = sub.add_parser("prepare", help="tokenize a dataset into the shared token cache")
    prepare.add_argument("--dataset", default="builtin")
    prepare.add_argument("--tokenizer", default="builtin")
    prepare.add_argument("--dataset-split", default=None)
    prepare.add_argument("--text-field", default=None)
    prepare.add_argument("--config", help="TOML config file, or a built-in one: demo")
    prepare.add_argument("--out", dest="cache_dir", help="cache directory (default: the user cache)")
    prepare.add_argument("--quiet", action="store_true", default=None)
    prepare.set_defaults(handler=cmd_prepare, paths={key: RUN_PATHS[key] for key in ("config", "dataset", "tokenizer")}
                         | {"cache_dir": ("--out", "out_dir")})

    run = sub.add_parser("run", help="train one framework at one world size")
    run.add_argument("--framework", help="mlx or torch")
    run.add_argument("--nproc", type=int, help="ranks on this machine")
    add_run_flags(run)
    run.add_argument("--resume", action="store_true", default=None, help="continue from the latest checkpoint")
    run.set_defaults(handler=cmd_run, paths=RUN_PATHS)

    compare = sub.add_parser("compare", help="run both frameworks at several world sizes and report")
    compare.add_argument("--frameworks", default="mlx,torch", help="comma list, e.g. mlx,torch")
    compare.add_argument("--nproc", default="1,2", help="comma list of world sizes, e.g. 1,2")
    compare.add_argument("--strategies", help="comma list of ddp, zero1, zero2, fsdp, tp, pp, cp (default: --strategy, or ddp); "
                         "without ddp, a 1 in --nproc still runs the ddp x1 reference")
    compare.add_argument("--dtypes", help="comma list of float32, bfloat16 (default: --dtype, or float32)")
    compare.add_argument("--strict", action="store_true", help="exit 3 when a parity verdict fails")
    compare.add_argument("--report-on-interrupt", action="store_true",
                         help="when stopped by a signal, still write the report from the runs that finished")
    compare.add_argument("--no-samples", action="store_true",
                         help="skip the report's greedy continuations (one process per run after training)")
    compare.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    compare.add_argument("--recipes", help="A,B: run recipes A and B and the chain between them, one choice changed "
                                           "per link, and explain the gap choice by choice (docs/recipes.md)")
    compare.add_argument("--recipe-from", help="RUN_A,RUN_B: your own mlx_lm.lora and Trainer/trl runs (folders, or "
                                               "recipe files import-run wrote), reproduced in both frameworks and "
                                               "their gap explained (docs/your-runs.md)")
    add_tolerance_flags(compare)
    add_baseline_flags(compare)
    add_run_flags(compare)
    add_submit_flags(compare)
    compare.set_defaults(handler=cmd_compare, paths={**RUN_PATHS, **BASELINE_PATHS})

    report = sub.add_parser(
        "report", help="rebuild the report from existing run directories",
        description="Rebuild the report from existing run directories. It only reads them and starts nothing: "
                    "the greedy continuations come from each run's sample.json and the diagnoses of failed "
                    "cross-framework pairs from <out>/diagnosis/*/finding.json, both written by `dpcompare "
                    "compare`; where they are missing (runs from `dpcompare run`, another --out, a run resumed "
                    "since), the report leaves that section or finding out (`dpcompare diagnose --from RUN_DIR` "
                    "diagnoses a pair by hand).")
    report.add_argument("runs", nargs="+", help="run directories, or a compare directory")
    report.add_argument("--out", help="where to write the report (default: the first argument)")
    report.add_argument("--strict", action="store_true")
    report.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    add_tolerance_flags(report)
    add_baseline_flags(report)
    report.set_defaults(handler=cmd_report, paths={"runs": ("run directory", "dir"), "out": ("--out", "out_dir"),
                                                   **BASELINE_PATHS})

    diagnose = sub.add_parser("diagnose", help="one step of each framework from the same weights: where do "
                                               "they part? (modules, loss, gradients, update)")
    diagnose.add_argument("--frameworks", default="mlx,torch", help="the two frameworks to compare")
    diagnose.add_argument("--from", dest="from_run", metavar="RUN_DIR",
                          help="start from this run's checkpoint (and its config; flags override it)")
    diagnose.add_argument("--step", type=int, help="with --from: the checkpoint after this many steps "
                                                   "(default: the latest)")
    diagnose.add_argument("--keep-tensors", action="store_true", help="keep every recorded tensor (.npy)")
    add_run_flags(diagnose)
    diagnose.set_defaults(handler=cmd_diagnose, paths={**RUN_PATHS, "from_run": ("--from", "dir")})

    plan = sub.add_parser("plan", help="predict step time, tokens/s and memory per rank at other world sizes, "
                                       "strategies and links, from a measured run (docs/scaling.md)")
    plan.add_argument("--from", dest="from_run", metavar="RUN_DIR", required=True, action="append",
                      help="a finished run to calibrate on (its summary.json's time breakdown and peak memory); with "
                           "--model, one per framework")
    plan.add_argument("--fit", action="append", metavar="RUN_DIR", help="a finished N=2 run of one strategy (fsdp, tp, "
                      "pp, ddp) of the same workload: its host work per byte moved is fitted and charged at "
                      "every N (repeat for each strategy; docs/scaling.md)")
    plan.add_argument("--nproc", default="2,4,8,16,64", help="comma list of world sizes (default 2,4,8,16,64)")
    plan.add_argument("--strategies", default="ddp,fsdp,tp",
                      help="comma list of ddp, zero1, zero2, fsdp, tp, pp, cp (default: ddp,fsdp,tp)")
    plan.add_argument("--fabric", metavar="FABRIC.json", help="the link as `dpcompare doctor --fabric --out` "
                                                              "measured it (the run's framework's entry)")
    plan.add_argument("--link-gbps", type=float, help="the link's bandwidth each way, Gbit/s (with --latency-us)")
    plan.add_argument("--latency-us", type=float, help="the link's one-hop latency, µs (with --link-gbps)")
    plan.add_argument("--group-size", type=int, help="two-level link: ranks per machine (consecutive ranks); the "
                                                     "--link-gbps/--fabric flags then give the link between machines")
    plan.add_argument("--fabric-inner", metavar="FABRIC.json", help="two-level link: the link inside a machine as "
                                                                    "`doctor --fabric --out` measured it")
    plan.add_argument("--link-gbps-inner", type=float, help="two-level link: bandwidth inside a machine, Gbit/s")
    plan.add_argument("--latency-us-inner", type=float, help="two-level link: one-hop latency inside a machine, µs")
    plan.add_argument("--meshes", action="store_true", help="every mesh of dp, fsdp, tp and pp per N (instead of "
                                                            "--strategies), the fastest named (docs/scaling.md)")
    plan.add_argument("--device-memory-gb", type=float, help="memory of each machine (or GPU), GB: say whether each "
                                                             "plan fits (with --model, default: this machine's)")
    plan.add_argument("--ranks-per-machine", type=int, default=1, help="ranks sharing one machine's memory (default "
                      "1): a layout fits where this many of its ranks do; 2 for two ranks on one 2-core machine. With "
                      "--rank-speed they share its cores too (docs/uneven.md)")
    plan.add_argument("--out", help="where plan.json and plan.png go (default RUN_DIR/plan)")
    from .plan.model import add_model_flags

    add_model_flags(plan)  # --model M and what trains: compare/plan/model.py
    plan.set_defaults(handler=cmd_plan, paths={"from_run": ("--from", "dir"), "fit": ("--fit", "dir"),
                                               "fabric": ("--fabric", "file"),
                                               "fabric_inner": ("--fabric-inner", "file"),
                                               "out": ("--out", "out_dir")})

    batches = sub.add_parser("batches", help="write each step's global batch (inputs, targets, mask) as the run saw "
                                             "it, for another implementation to be fed the same data")
    batches.add_argument("run_dir")
    batches.add_argument("--steps", required=True, help="A:B (0-based, B excluded), A: or A")
    batches.add_argument("--out", required=True, help="an .npz file (never overwritten)")
    batches.set_defaults(handler=cmd_batches, paths={"run_dir": ("run directory", "dir"), "out": ("--out", "out_file")})

    export = sub.add_parser("export", help="export a run's latest checkpoint as an HF Llama directory")
    export.add_argument("run_dir")
    export.add_argument("--out", required=True)
    export.add_argument("--adapters", choices=("mlx-lm", "peft"),
                        help="a LoRA run: its adapters in mlx-lm's or peft's layout, the base beside them in OUT/base "
                             "(without it, a LoRA run exports the fused folder)")
    export.set_defaults(handler=cmd_export, paths={"run_dir": ("run directory", "dir"), "out": ("--out", "out_dir")})
    import_run.add_parser(sub)
    return parser


def cmd_doctor(args) -> int:
    from .doctor import doctor

    if not args.fabric:
        if args.hostfile or args.backend or args.link or args.out:
            raise UserError("--hostfile, --backend, --link and --out go with doctor --fabric")
        print(doctor(measure_peak=args.peak))
        return 0
    from .machine.fabric import Workload, fabric

    if args.peak:
        print(doctor(measure_peak=True) + "\n")
    if args.nproc < 2 or args.max_mb <= 0 or args.time_budget_s <= 0 or args.max_calls <= 0:
        raise UserError("doctor --fabric needs --nproc >= 2 and a positive --max-mb, --time-budget-s and --max-calls")
    if args.out and not Path(args.out).resolve().parent.is_dir():  # refused now, not after the measurement
        raise UserError(f"--out {args.out}: directory {Path(args.out).resolve().parent} not found")
    workload = Workload(args.preset, args.seq_len, args.global_batch_size)
    RunConfig(preset=args.preset, seq_len=args.seq_len, global_batch_size=args.global_batch_size).validate()
    rows = []
    report, code = fabric(nproc=args.nproc, hostfile=args.hostfile, backend=args.backend, max_mb=args.max_mb,
                          time_budget_s=args.time_budget_s, max_calls=args.max_calls, workload=workload,
                          link=args.link, rows_out=rows)
    print(report, flush=True)
    if args.out:
        from .plan import write_fabric

        shaped = args.link  # doctor --fabric --link RATE: the figures are those of that emulated link
        write_fabric(args.out, rows, f"the hosts of {args.hostfile}" if args.hostfile else f"{args.nproc} local ranks",
                     {"requested": shaped} if shaped else None)
        print(f"figures for `dpcompare plan --fabric`: {args.out}")
    return code


def cmd_prepare(args) -> int:
    from common.data.tokencache import describe

    from .launch.runner import prepare_inputs

    cfg = config_from_args(args)
    inputs = prepare_inputs(cfg)
    from common.data.tokencache import TokenCache

    print(describe(TokenCache.open(inputs.token_cache)))
    print(f"model spec for this tokenizer ({cfg.preset}): vocab_size={inputs.spec.vocab_size}")
    return 0


def cmd_run(args) -> int:
    from .launch.runner import launch, prepare_inputs

    cfg = config_from_args(args)
    from .launch import slurm

    # Inside a Slurm allocation, as many ranks as the job has tasks unless --nproc (or the TOML) says otherwise.
    cfg = slurm.sized_to_allocation(cfg, nproc_given=args.nproc is not None or "nproc" in
                                    (read_toml(args.config) if args.config else {}))
    run_dir = Path(cfg.out or args.start_dir / default_out(cfg))
    from .machine.backends import check_available
    from .launch.netns import check_can_emulate
    from .launch.runner import check_hostfile, check_run_dir

    check_run_dir(run_dir, cfg.resume, cfg.overwrite)
    check_hostfile(cfg)
    check_available(cfg)
    slurm.check(cfg)
    if cfg.link:  # before the data is prepared, as compare does; one rank has no link to shape
        if cfg.world_size == 1:
            raise UserError(f"--link {cfg.link} shapes the link between ranks, and --nproc 1 has none: "
                            "pass --nproc 2 or more")
        check_can_emulate(cfg.link)
    inputs = prepare_inputs(cfg)
    from .launch.linknotes import hf_gather_note
    from .machine.sharing import ring_polling_note

    from .plan.model import memory_warning  # issue 56: warn, never refuse, when the ranks would not fit here

    for note in filter(None, (hf_gather_note(cfg, inputs.spec), ring_polling_note(cfg), memory_warning(cfg, inputs.spec))):
        print(f"dpcompare: note: {note}", file=sys.stderr)
    summary = launch(cfg, inputs, run_dir)
    if summary["status"] == "ok":
        from .plan import add_memory_predictions

        add_memory_predictions([run_dir])  # the predicted peak per rank beside the measured one (summary.json)
    return print_run_result(summary, run_dir)


def print_run_result(summary: dict, run_dir: Path) -> int:
    from .report.restarts import restart_line

    for record in summary.get("restarts") or []:  # --max-restarts: one line each
        print(restart_line(record, summary["max_restarts"]), file=sys.stderr)
    if summary["status"] != "ok":
        print(f"dpcompare: error: {summary['framework']} x{summary['world_size']}: {summary.get('error')} "
              f"(log: {run_dir / 'log.txt'})", file=sys.stderr)
        return 1
    tps = summary.get("tokens_per_s")
    rate = f"{tps:,.0f} tokens/s (median)" if tps is not None else "tokens/s: see node 0's metrics"
    loss = f"{summary['final_loss']:.4f}" if summary.get("final_loss") is not None else "n/a"
    print(f"{summary['framework']} x{summary['world_size']}: {summary['steps']} steps, final loss "
          f"{loss}, {rate}, wall {summary['wall_s']:.1f} s -> {run_dir}")
    return 0


def default_out(cfg: RunConfig) -> str:
    import time

    return f"runs/{cfg.framework}-n{cfg.world_size}-{time.strftime('%Y%m%d-%H%M%S')}"


def cmd_compare(args) -> int:
    from .matrix import run_matrix

    return run_matrix(args)


def cmd_report(args) -> int:
    from .matrix import rebuild_report

    return rebuild_report(args)


def cmd_diagnose(args) -> int:
    from common.config import FRAMEWORKS

    from .diagnose import DiagnosisError, diagnose, run_config, table
    from .matrix import parse_list

    frameworks = parse_list(args.frameworks, "frameworks", allowed=FRAMEWORKS)
    if args.step is not None and not args.from_run:
        raise UserError("--step needs --from RUN_DIR")
    base = run_config(Path(args.from_run)).to_dict() if args.from_run else None
    cfg = config_from_args(args, base=base, framework=frameworks[0], nproc=1, strategy="ddp")  # one process each
    out = Path(args.out or (Path(args.from_run) / "diagnosis" if args.from_run else args.start_dir / "runs/diagnose"))
    try:
        result = diagnose(cfg, out, from_run=args.from_run, step=args.step, frameworks=frameworks,
                          keep_tensors=args.keep_tensors)
    except DiagnosisError as err:
        print(f"dpcompare: error: {err}", file=sys.stderr)
        return 1
    print(table(result))
    print(f"\ndiagnosis: {out / 'diagnosis.json'}")
    return 0


def cmd_plan(args) -> int:
    from .plan import run_plan

    return run_plan(args)


def cmd_batches(args) -> int:
    from .batches import write_batches

    written = write_batches(Path(args.run_dir), args.steps, Path(args.out))
    print(f"wrote {written} step(s) of {args.run_dir}'s global batches -> {args.out} (inputs, targets, mask, "
          "indices, tokens; numpy.load reads it)")
    return 0


def cmd_export(args) -> int:
    from .export import export_run

    ckpt = export_run(Path(args.run_dir), Path(args.out), args.adapters)
    if args.adapters == "mlx-lm":
        print(f"exported the adapters of {ckpt} -> {args.out}: mlx_lm.generate --model {args.out}/base "
              f"--adapter-path {args.out}")
    elif args.adapters == "peft":
        print(f"exported the adapters of {ckpt} -> {args.out}: PeftModel.from_pretrained(AutoModelForCausalLM."
              f"from_pretrained('{args.out}/base'), '{args.out}')")
    else:
        print(f"exported {ckpt} -> {args.out} (weights, tokenizer and generation config: opens with transformers' "
              f"pipeline('text-generation', model=DIR) and mlx_lm.generate --model DIR)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
