"""--trace: every rank writes a Chrome trace of extra steps after the run, holding dpcompare's phases, and
the summary and report list the files; without --trace nothing is written. (common/train/trace.py)"""
import json

from helpers import summary

PHASES = {"step 1", "step 2", "forward", "backward", "optimizer"}


def complete_events(path) -> list[dict]:
    trace = json.loads(path.read_text())  # valid JSON, as Perfetto and chrome://tracing load it
    return [e for e in trace["traceEvents"] if e.get("ph") == "X"]


def test_every_rank_of_a_traced_run_writes_a_chrome_trace_of_the_phases_and_the_report_lists_them(matrix):
    out = matrix.out  # compared with --trace
    for framework in ("mlx", "torch"):
        for n in (1, 2):
            run = out / f"{framework}-n{n}"
            assert summary(run)["trace"] == [f"trace/rank{r}.json" for r in range(n)]
            for r in range(n):
                events = complete_events(run / "trace" / f"rank{r}.json")
                names = {e["name"] for e in events}
                assert PHASES <= names, (run, r, sorted(names)[:20])
                assert all(e["dur"] >= 0 for e in events)
                backward = [e for e in events if e["name"] == "backward"]
                if framework == "mlx":
                    assert {e["pid"] for e in events} == {r}
                    # MLX's gradient sync runs after the backward, in a phase of its own
                    assert ("communication" in names) == (n > 1)
                elif n > 1:  # DDP all-reduces from the backward's hooks: the profiler shows it there
                    assert any("allreduce" in e["name"].replace("_", "") and
                               any(b["ts"] <= e["ts"] <= b["ts"] + b["dur"] for b in backward) for e in events)
    report = (out / "report.md").read_text()
    assert "ui.perfetto.dev" in report and str(out / "torch-n2" / "trace" / "rank1.json") in report


def test_a_run_without_trace_writes_no_trace(uninterrupted):
    out = uninterrupted("mlx", "ddp", 1)  # a session run (integration/conftest.py), trained without --trace
    assert json.loads((out / "run_config.json").read_text())["config"]["trace"] is False
    assert not (out / "trace").exists() and summary(out)["trace"] == []
