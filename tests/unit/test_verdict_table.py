"""The verdict of a large matrix reads as a table: one line per judged pair, failures first, and the sentence
of each failure after the table; speed ratios in a table of their own. Run directories are synthetic but
written with the real schema (test_parity.make_run): the report reads what real runs leave."""
from __future__ import annotations

import contextlib
import io
import re

import pytest

from common.metrics import read_json, write_json
from compare.cli import build_parser, main
from compare.report.parity import PAIR_KINDS, Tolerances
from compare.report.verdict_table import SPEED_NAMES, check_cell, rel_pct
from compare.report.writer import terminal_table, write_report
from unit.fake_runs import make_run, reference_losses

CONTEXT = {"peaks": {}, "accelerator": None}


def faster_lr(factor: float) -> list[float]:
    """The curve of a run whose learning rate is `factor` x the others': it falls faster from step 2 on."""
    base = reference_losses()
    return [base[0]] + [x - (factor - 1) * 0.05 * min(s, 10) for s, x in enumerate(base[1:], start=1)]


@contextlib.contextmanager
def without_figures():
    """The report of a 20-run matrix without its PNGs: matplotlib drew them in 2.5 of these fixtures' 3 s, and no
    test here reads a figure (tests/unit/test_report.py checks that every file is written)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("compare.report.writer.make_plots", lambda *args, **kwargs: {})
        yield


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """`compare --strategies ddp,fsdp,tp,pp --dtypes float32,bfloat16 --nproc 1,2`: 20 runs (non-ddp
    strategies need 2 ranks), torch fsdp x2 with a planted learning rate that its config does not show, and
    mlx tp bf16 x2 with one that it does (so it cannot be compared)."""
    root = tmp_path_factory.mktemp("matrix")
    dirs = []
    for fw in ("mlx", "torch"):
        for dtype in ("float32", "bfloat16"):
            for strategy in ("ddp", "fsdp", "tp", "pp"):
                for n in (1, 2):
                    if strategy != "ddp" and n == 1:
                        continue
                    losses, config = None, {"strategy": strategy, "dtype": dtype}
                    if (fw, strategy, dtype, n) == ("torch", "fsdp", "float32", 2):
                        losses = faster_lr(1.5)
                    if (fw, strategy, dtype, n) == ("mlx", "tp", "bfloat16", 2):
                        config["lr"] = 1e-3
                    dirs.append(make_run(root, fw, n, losses, config=config, evals={20: 3.1, 40: 2.9},
                                         name=f"{fw}-{strategy}-{dtype}-n{n}"))
    with without_figures():
        summary = write_report(dirs, root / "report", Tolerances(), CONTEXT)
    return root / "report", summary


def test_every_judged_pair_is_one_line_of_one_table_and_failures_come_first(matrix):
    _, summary = matrix
    pairs = [p for kind in PAIR_KINDS for p in summary["parity"][kind]]
    text = terminal_table(summary)
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("verdict  "))
    rows = lines[header + 2:header + 2 + len(pairs)]
    assert len(rows) == len(pairs) and lines[header + 2 + len(pairs)] == ""  # one table, nothing else in it
    for pair in pairs:  # each pair on exactly one line of the table
        assert sum(f"  {pair['a']} vs {pair['b']}  " in row for row in rows) == 1, pair
    verdicts = [row.split()[0] for row in rows]
    assert verdicts == sorted(verdicts, key=["FAIL", "NOT", "PASS"].index)
    assert rows[0].startswith("FAIL") and "torch fsdp x2" in rows[0]
    assert not any(" matches " in line for line in lines)  # the passing pairs are rows, not sentences


def test_the_planted_learning_rate_fails_at_the_top_with_its_sentence_after_the_table(matrix):
    _, summary = matrix
    failed = [r for r in summary["verdicts"]["pairs"] if r["verdict"] == "fail"]
    assert {r["pair"] for r in failed} >= {"mlx fsdp x2 vs torch fsdp x2", "torch fsdp x2 vs torch x2"}
    assert all("torch fsdp x2" in r["pair"] or "torch fsdp bf16 x2" in r["pair"] for r in failed)
    strategy = next(r for r in failed if r["pair"] == "torch fsdp x2 vs torch x2")
    assert re.fullmatch(r"\d\.\d\de-\d\d > 0\.0001 at step \d+", strategy["per_step"]), strategy
    text = terminal_table(summary)
    table_end = text.index("\n\n! ")
    sentence = "! Strategy, fsdp: torch fsdp x2 does NOT match torch x2: max |Δloss|"
    assert sentence in text and text.index(sentence) > table_end
    assert text.index("PASS ") < table_end < text.index("speed  ")  # pairs, their failures, then speed


def test_a_changed_config_is_not_comparable_and_says_what_differs(matrix):
    _, summary = matrix
    rows = [r for r in summary["verdicts"]["pairs"] if "mlx tp bf16 x2" in r["pair"]]
    assert rows and all(r["verdict"] == "not comparable" for r in rows)
    assert summary["verdicts"]["headline"] == f"parity FAIL ({len(rows)} pair(s) not comparable)"
    first_pass = next(i for i, r in enumerate(summary["verdicts"]["pairs"]) if r["verdict"] == "pass")
    assert all(summary["verdicts"]["pairs"].index(r) < first_pass for r in rows)
    assert any(line.startswith("Strategy, tp: mlx tp bf16 x2 and mlx bf16 x1 are not comparable: their configs "
                               "differ in lr (0.001 vs 0.0003)") for line in summary["verdicts"]["failures"])


def test_report_md_and_html_show_the_same_table_first(matrix):
    out, summary = matrix
    md = (out / "report.md").read_text()
    head = md[md.index("## Verdict"):md.index("## Runs")]
    table = [line for line in head.splitlines() if line.startswith("| ")][:2 + len(summary["verdicts"]["pairs"])]
    assert table[0].startswith("| verdict | kind | pair | per-step max \\|Δloss\\|")
    assert table[2].startswith("| fail | MLX vs torch | mlx fsdp x2 vs torch fsdp x2 |")
    sentence = head.index("- **Strategy, fsdp:** torch fsdp x2 does NOT match")
    assert head.index(table[-1]) < sentence < head.index("| speed | runs |")
    page = (out / "report.html").read_text()
    verdict = page[page.index('<div class="verdict fail">'):page.index("<h2>Runs</h2>")]
    scaled_groups = len(summary["scaling"])  # every group has a run at 2 ranks; no run records its state
    assert verdict.count("<tr>") == 3 + len(summary["verdicts"]["pairs"]) + len(summary["speed"]) + scaled_groups
    assert verdict.index("mlx fsdp x2 vs torch fsdp x2") < verdict.index('<li class="failure">')
    assert "Parity</h2>" in page and "verdict table at the top" in page  # no second copy of the pairs


def test_speed_is_a_table_of_its_own_that_keeps_mlx_vs_torch_and_verbose_keeps_every_ratio(matrix):
    _, summary = matrix
    for verbose, kinds in ((False, {"framework"}), (True, {"framework", "strategy", "dtype"})):
        text = terminal_table(summary, verbose=verbose)
        speed = text[text.index("speed  "):].split("\n\n")[0].splitlines()[2:]
        assert len(speed) == sum(s["kind"] in kinds for s in summary["speed"])
        assert all(re.search(r" \d+\.\d\dx ", row) for row in speed)
        assert "Speed, N=" not in text  # no longer one sentence per pair


def test_a_check_cell_shows_the_value_against_its_tolerance():
    assert check_cell({"verdict": "pass", "max_abs_diff": 2e-6, "tolerance": 1e-4}, "max_abs_diff", False) == \
        "2.00e-06 ≤ 0.0001"
    assert check_cell({"verdict": "fail", "max_rel_diff": 0.03, "tolerance": 0.02, "at_step": 7}, "max_rel_diff",
                      True) == "3% > 2% at step 7"
    assert check_cell({"verdict": "no data"}, "max_abs_diff", False) == "–"
    assert rel_pct(0) == "0%" and rel_pct(1e-7) == "<0.001%"


# ---- the issue's matrix: the terminal verdict fits a screen (issue 59) ---------------------------

ISSUE_MATRIX = "compare --frameworks mlx,torch --strategies ddp,fsdp,tp,pp --dtypes float32,bfloat16 --nproc 1,2"
SCREEN_LINES = 60


@pytest.fixture(scope="module")
def issue_matrix(tmp_path_factory):
    """The runs of `dpcompare {ISSUE_MATRIX}` (16 at 2 ranks, ddp x1 of each framework and dtype; fsdp, tp and pp
    need 2 ranks), every pair passing, torch faster, bf16 faster, sharded strategies holding half the state;
    the MLX ring runs fill the fake machine's 2 CPUs, so each draws the ring-polling warning. Reported with
    `dpcompare report` in process: (report dir, summary, what it printed)."""
    root = tmp_path_factory.mktemp("issue-matrix")
    dirs = []
    for fw in ("mlx", "torch"):
        for dtype in ("float32", "bfloat16"):
            for strategy in ("ddp", "fsdp", "tp", "pp"):
                for n in (1, 2):
                    if strategy != "ddp" and n == 1:
                        continue
                    rate = 10_000 * (1.2 if fw == "torch" else 1) * (1.5 if dtype == "bfloat16" else 1) * \
                        (1 if n == 1 else 0.9 * n)  # 90% efficiency
                    run = make_run(root, fw, n, config={"strategy": strategy, "dtype": dtype}, tokens_per_s=rate,
                                   evals={20: 3.1, 40: 2.9}, name=f"{fw}-{strategy}-{dtype}-n{n}")
                    share = 1 if strategy == "ddp" else 1 / n
                    summary = read_json(run / "summary.json")
                    summary["state_bytes"] = {"params": [4e6 * share] * n, "grads": [4e6 * share] * n,
                                              "optimizer": [8e6 * share] * n}
                    write_json(run / "summary.json", summary)
                    dirs.append(run)
    out = root / "report"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        with without_figures():
            assert main(["report", *map(str, dirs), "--out", str(out)]) == 0
    return out, read_json(out / "summary.json"), printed.getvalue()


def verdict_block(printed: str) -> list[str]:
    """The printed lines from `verdict:` to `report:`, both included."""
    lines = printed.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("verdict:"))
    end = next(i for i, line in enumerate(lines) if line.startswith("report:"))
    return lines[start:end + 1]


def test_the_issue_matrix_verdict_fits_a_screen_and_repeats_no_line(issue_matrix):
    _, summary, printed = issue_matrix
    assert len(summary["runs"]) == 20 and summary["verdicts"]["headline"] == "parity PASS"
    block = verdict_block(printed)
    assert len(block) <= SCREEN_LINES, "\n".join(block)
    text = [line for line in block if line.strip()]  # blank lines only separate the tables
    assert len(text) == len(set(text)), [line for line in text if text.count(line) > 1]


def test_a_warning_for_several_runs_prints_once_naming_each(issue_matrix):
    _, summary, printed = issue_matrix
    polling = [line for line in verdict_block(printed) if "polls its sockets" in line]
    ring_runs = [r["label"] for r in summary["runs"] if r["framework"] == "mlx" and r["world_size"] == 2]
    assert len(polling) == 1 and len(ring_runs) == 8
    assert polling[0].startswith("! " + ", ".join(ring_runs) + ": MLX's ring polls its sockets")


def test_the_terminal_keeps_mlx_vs_torch_at_each_configuration_and_points_to_the_rest(issue_matrix):
    _, summary, printed = issue_matrix
    block = verdict_block(printed)
    speed = [line for line in block if line.startswith(("MLX vs torch  ", "strategy vs ddp  ", "bf16 vs fp32  "))]
    configurations = {(r["strategy"], r["dtype"], r["world_size"]) for r in summary["runs"]}
    assert len(speed) == len(configurations) == 10 and all(line.startswith("MLX vs torch  ") for line in speed)
    assert "- In the report, or with --verbose: 22 more speed ratios (each strategy vs ddp, bf16 vs fp32); " \
           "scaling and memory by run group" in block
    assert not any(line.startswith(("- Scaling, ", "- Memory, ")) for line in block)  # no more bullets
    runs = printed.splitlines()[2:2 + len(summary["runs"])]  # each run's scaling and state stand in its line
    assert any(line.startswith("mlx fsdp x2 ") and " 90% " in line and " 8.0 (0.50x) " in line for line in runs)


def test_verbose_prints_every_ratio_then_scaling_and_memory_one_row_per_run_group(issue_matrix):
    _, summary, _ = issue_matrix
    text = terminal_table(summary, verbose=True)
    tables = {block.splitlines()[0].split()[0]: block.splitlines()[2:] for block in text.split("\n\n")
              if len(block.splitlines()) > 2 and set(block.splitlines()[1]) <= {"-", " "}}
    assert len(tables["speed"]) == len(summary["speed"]) == 32
    groups = {" ".join(r["label"].split()[:-1]) for r in summary["runs"]}
    assert sorted(row.split("  ")[0].strip() for row in tables["scaling"]) == sorted(groups)  # 16
    assert len(tables["memory"]) == 12 and all("8.0 vs 16.0 (0.50x)" in row for row in tables["memory"])
    assert build_parser().parse_args(["compare", "--verbose"]).verbose
    assert build_parser().parse_args(["report", "runs", "--verbose"]).verbose


def test_report_md_keeps_every_speed_ratio_and_every_runs_scaling_and_memory(issue_matrix):
    out, summary, _ = issue_matrix
    md = (out / "report.md").read_text()
    verdict = md[md.index("## Verdict"):md.index("## Runs")]
    for s in summary["speed"]:
        assert f"| {SPEED_NAMES[s['kind']]} | {s['a']} vs {s['b']} | {s['faster']} | {s['speedup']:.2f}x |" in verdict
    for group, points in summary["scaling"].items():
        for p in points:
            if p["world_size"] > 1:
                assert re.search(rf"\| {group} \| [^|]+ \| {p['speedup']:.2f}x \({100 * p['efficiency']:.0f}%\) \|",
                                 verdict), group
    for m in summary["memory"]:
        assert f"| {m['group']} | {m['state_mb']:,.1f} vs {m['ddp_state_mb']:,.1f} ({m['ratio']:.2f}x) |" in verdict
    assert len(summary["memory"]) == 12 and len(summary["scaling"]) == 16
