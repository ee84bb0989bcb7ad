"""--max-restarts and --min-nproc bookkeeping without processes: the world size a shrunk job goes on at, the
restarts list, one metrics curve, the causes never retried, the test-only fault, and a survivor's save."""
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

from common.config import RunConfig
from common.errors import UserError
from common.train import rescue
from common.train.faults import Fault, injected_fault
from compare.launch.hosts import HOST_WAIT_ENV, host_wait_s, unanswered
from compare.launch.restarts import RESTART_HOSTFILE, Restarts, cause_of, merge_rescued_row, next_world
from compare.report.restarts import restart_blocks, restart_line


def test_a_shrunk_job_keeps_the_global_batch_and_its_micro_batch():
    cfg = RunConfig(preset="tiny", global_batch_size=8, nproc=2)  # micro-batch 4
    smaller, passed = next_world(cfg, 1)
    assert (smaller.nproc, smaller.grad_accum, smaller.micro_batch_size, smaller.strategy) == (1, 2, 4, "ddp")
    assert passed == []


def test_a_world_size_that_cannot_split_the_batch_is_passed_over_by_name():
    cfg = RunConfig(preset="tiny", global_batch_size=8, nproc=4)  # micro-batch 2: 3 ranks cannot cut 8
    smaller, passed = next_world(cfg, 2)
    assert (smaller.nproc, smaller.grad_accum) == (2, 2)
    assert len(passed) == 1 and passed[0].startswith("3 ranks: global batch 8")


def test_at_one_rank_fsdp_goes_on_as_ddp_and_says_so():
    cfg = RunConfig(preset="tiny", global_batch_size=8, nproc=2, strategy="fsdp")
    smaller, passed = next_world(cfg, 1)
    assert (smaller.nproc, smaller.strategy) == (1, "ddp") and "ddp instead" in passed[-1]


def test_no_world_size_above_the_minimum_gives_none_with_the_reasons():
    cfg = RunConfig(preset="tiny", global_batch_size=8, nproc=4)
    smaller, passed = next_world(cfg, 3)
    assert smaller is None and passed and "3 ranks" in passed[0]


def mesh_config(mesh: str, nproc: int, **fields) -> RunConfig:
    return RunConfig.from_dict({"preset": "tiny", "global_batch_size": 8, "nproc": nproc, "mesh": mesh,
                                "backend": "gloo", "framework": "torch", **fields})


def test_a_restarted_mesh_keeps_its_mesh_and_the_survivor_question_asks_the_mesh(tmp_path):
    """The restart of a mesh run exited 2 with '--strategy mesh needs --mesh' (issue 59): the survivor question
    rebuilt a one-axis layout from the strategy's name. The next start is the run's own config, resumed."""
    cfg = mesh_config("dp=2,tp=2", 4, max_restarts=1)
    restarts = Restarts(cfg)
    assert not restarts.can_rescue(cfg, {"cause": "died", "error": ""}, {}, tmp_path)  # tp's state is split
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3)))
    nxt = restarts.after_failure(cfg, {"cause": "died", "failed_rank": 3, "error": "rank 3 died"}, tmp_path,
                                 time.time(), {}, None)
    assert nxt == cfg.replace(resume=True) and restarts.records[-1]["mesh_after"] == "dp=2,tp=2"


@pytest.mark.parametrize("mesh, nproc, shrunk", [("dp=2,tp=2", 4, ("tp", "", 2, 2)),
                                                 ("pp=2,dp=2", 4, ("pp", "", 2, 2)),
                                                 ("dp=3,tp=2", 6, ("mesh", "dp=2,tp=2", 4, 2))])
def test_a_mesh_shrinks_its_data_axis_and_keeps_its_model_axes(mesh, nproc, shrunk):
    cfg = mesh_config(mesh, nproc, global_batch_size=12 if nproc == 6 else 8)
    smaller, passed = next_world(cfg, 1)
    assert (smaller.strategy, smaller.mesh, smaller.nproc, smaller.grad_accum) == shrunk, passed
    assert smaller.micro_batch_size <= cfg.micro_batch_size and all("do not divide" in p for p in passed[:1])


def test_a_mesh_without_a_data_axis_cannot_shrink_and_says_why():
    smaller, passed = next_world(mesh_config("pp=2,tp=2", 4, pp_microbatches=2), 1)
    assert smaller.nproc == 1 and smaller.strategy == "ddp" and "ranks" in passed[0]


@pytest.mark.parametrize("fields, message", [({"max_restarts": -1}, "max_restarts must be >= 0"),
                                             ({"nproc": 2, "min_nproc": 3}, "min_nproc must be in [1, nproc=2]")])
def test_bad_restart_flags_are_refused_in_one_line(fields, message):
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]")):
        RunConfig(**fields).validate()


def rows(path, steps):
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in steps))


def test_the_survivors_row_is_appended_once_where_rank_0_died_before_writing_it(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    rows(metrics, range(1, 6))
    assert merge_rescued_row(metrics, {"step": 6, "row": {"step": 6, "loss": 0.5}}) == 6
    assert merge_rescued_row(metrics, {"step": 6, "row": {"step": 6, "loss": 0.5}}) == 6  # not twice
    assert merge_rescued_row(metrics, None) == 6
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == list(range(1, 7))


def checkpoint_at(run_dir, step):
    folder = run_dir / "checkpoints" / f"step_{step:06d}"
    folder.mkdir(parents=True)
    (folder / "state.json").write_text(json.dumps({"step": step}))
    (run_dir / "checkpoints" / "latest").write_text(folder.name + "\n")


def died(step, rank=1):
    return {"failed_rank": rank, "cause": "died", "error": f"rank {rank} died in step {step}"}


def test_restarts_are_recorded_until_exhausted_and_the_last_failure_says_so(tmp_path):
    cfg = RunConfig(preset="tiny", nproc=2, strategy="fsdp", max_restarts=1)
    rows(tmp_path / "metrics.jsonl", range(1, 6))
    checkpoint_at(tmp_path, 4)
    restarts = Restarts(cfg)
    nxt = restarts.after_failure(cfg, died(6), tmp_path, time.time(), {}, None)
    assert nxt is not None and nxt.resume and nxt.nproc == 2
    record = restarts.records[0]
    assert {k: record[k] for k in ("step", "cause", "rank", "resumed_from", "steps_lost", "how")} == \
        {"step": 6, "cause": "died", "rank": 1, "resumed_from": 4, "steps_lost": 1, "how": "last_checkpoint"}
    last = died(6)
    assert restarts.after_failure(nxt, last, tmp_path, time.time(), {}, None) is None
    assert "restarts exhausted: 1" in last["error"] and len(restarts.records) == 1


def test_a_survivors_checkpoint_loses_no_step(tmp_path):
    cfg = RunConfig(preset="tiny", nproc=2, max_restarts=1)
    rows(tmp_path / "metrics.jsonl", range(1, 6))
    checkpoint_at(tmp_path, 5)
    restarts = Restarts(cfg)
    restarts.after_failure(cfg, died(6), tmp_path, time.time(), {}, {"step": 5, "row": {"step": 5}})
    assert restarts.records[0]["steps_lost"] == 0 and restarts.records[0]["how"] == "survivor_checkpoint"
    assert "a survivor saved step 5 (0 steps lost)" in restart_line(restarts.records[0], 1)


def test_a_rank_that_dies_at_every_start_shrinks_the_job_to_min_nproc(tmp_path):
    cfg = RunConfig(preset="tiny", nproc=2, global_batch_size=8, max_restarts=3, min_nproc=1)
    rows(tmp_path / "metrics.jsonl", range(1, 6))
    checkpoint_at(tmp_path, 5)
    restarts = Restarts(cfg)
    again = restarts.after_failure(cfg, died(6), tmp_path, time.time(), {}, None)
    assert again.nproc == 2  # the first failure: try to get both ranks back
    shrunk = restarts.after_failure(again, died(6), tmp_path, time.time(), {}, None)  # no step past 5 again
    assert (shrunk.nproc, shrunk.grad_accum) == (1, 2)
    line = restart_line(restarts.records[-1], 3)
    assert "shrank 2 -> 1 ranks (grad accum 2, same global batch)" in line
    blocks = restart_blocks([{"label": "torch x1", "restarts": restarts.records, "max_restarts": 3}])
    assert blocks[0] == ("h2", "Restarts") and len(blocks[1][1]) == 2


def test_without_min_nproc_a_rank_that_keeps_dying_is_restarted_at_the_same_size(tmp_path):
    cfg = RunConfig(preset="tiny", nproc=2, max_restarts=3)
    rows(tmp_path / "metrics.jsonl", range(1, 6))
    restarts = Restarts(cfg)
    first = restarts.after_failure(cfg, died(6), tmp_path, time.time(), {}, None)
    assert restarts.after_failure(first, died(6), tmp_path, time.time(), {}, None).nproc == 2


@pytest.mark.parametrize("statuses", [{}, {0: {"error": "OSError: [Errno 28] No space left on device: '/x'"}}])
def test_a_full_disk_is_never_restarted(tmp_path, statuses):
    cfg = RunConfig(preset="tiny", nproc=2, max_restarts=2)
    failure = ({"failed_rank": 0, "cause": "disk full", "error": "[Errno 28] No space left on device"}
               if not statuses else died(6))  # the rank blamed may only have lost its peer
    assert cause_of(failure, statuses, tmp_path) == "disk full"
    assert Restarts(cfg).after_failure(cfg, failure, tmp_path, time.time(), statuses, None) is None
    assert "a full disk is not retried" in failure["error"]


def test_a_non_finite_loss_is_never_restarted(tmp_path):
    cfg = RunConfig(preset="tiny", nproc=2, max_restarts=2)
    failure = {"failed_rank": 0, "cause": "failed", "error": "rank 0 failed in step 3: TrainingError: loss is nan at "
                                                             "step 3; stopping (the last checkpoint is kept)"}
    assert Restarts(cfg).after_failure(cfg, failure, tmp_path, time.time(), {}, None) is None
    assert "come back at every restart" in failure["error"]
    assert cause_of({"cause": "died", "error": "rank 1 died in step 3"}, {}, tmp_path) == "died"


def test_the_injected_fault_hits_once_per_run_its_attempt_or_every_start_at_its_world_size(monkeypatch, tmp_path):
    monkeypatch.setenv("DPCOMPARE_SUPERVISOR", "host:1:2")
    monkeypatch.setenv("DPCOMPARE_INJECT_FAULT", "framework=torch,rank=1,step=6,signal=KILL")
    once = injected_fault("torch")
    assert once == Fault(step=6, rank=1, signal="KILL") and injected_fault("mlx") is None
    assert once.due(1, 2, 6, 0, tmp_path) and not once.due(0, 2, 6, 0, tmp_path)
    (tmp_path / "ranks").mkdir()
    with pytest.raises(RuntimeError, match="injected fault at step 6"):  # no signal: it raises (KILL would end pytest)
        Fault(step=6, rank=1).strike(6, type("Status", (), {"update": lambda self, **kw: None})(), tmp_path)
    assert not once.due(1, 2, 6, 5, tmp_path)  # the start after it is not hit again
    monkeypatch.setenv("DPCOMPARE_SUPERVISOR", "host:3:4")
    assert once.due(1, 2, 6, 0, tmp_path)  # another dpcompare's run in the same directory is
    monkeypatch.setenv("DPCOMPARE_INJECT_FAULT", "framework=torch,rank=1,step=6,attempt=1")
    monkeypatch.setenv("DPCOMPARE_ATTEMPT", "1")
    assert injected_fault("torch").due(1, 2, 6, 0, tmp_path)
    monkeypatch.setenv("DPCOMPARE_INJECT_FAULT", "rank=1,step=6,signal=SIGSTOP,world=2")
    every = injected_fault("mlx")
    assert every.signal == "STOP" and every.due(1, 2, 9, 8, tmp_path) and not every.due(1, 1, 9, 8, tmp_path)


def test_a_survivor_saves_its_last_kept_step_when_asked(tmp_path):
    saved = []
    (tmp_path / "ranks").mkdir()

    def save(step, state):
        saved.append((step, state))
        return tmp_path / f"step_{step:06d}"

    keeper = rescue.Rescue(tmp_path, 1, save)
    live = {"w": np.ones(3, dtype=np.float32)}
    state = rescue.copy_state([iter(live.items()), iter(live.items()), iter(live.items())])
    live["w"] += 1  # the next step changes the live tensors; the kept copy must not move
    keeper.keep(7, state, {"step": 7, "loss": 2.0})
    rescue.request(tmp_path, 1)
    keeper.linger(5)
    answer = rescue.answer(tmp_path)
    assert answer["step"] == 7 and answer["row"]["loss"] == 2.0 and saved[0][0] == 7
    np.testing.assert_array_equal(saved[0][1][0]["w"], np.ones(3))


def test_the_first_step_after_a_start_gets_the_start_up_grace_and_later_steps_do_not():
    from compare.launch.watchdog import starting

    resumed = {0: {"step": 5, "start_step": 5, "status": "running"}, 1: {"step": 5, "start_step": 5, "status": "running"}}
    assert starting(resumed, [0, 1], local=True)  # compiling its first step
    assert starting({0: resumed[0]}, [0, 1], local=True)  # rank 1 not joined yet
    assert not starting({**resumed, 1: {"step": 6, "start_step": 5, "status": "running"}}, [0, 1], local=True)


def test_immutable_state_is_kept_without_a_copy():
    live = {"w": np.ones(3, dtype=np.float32)}
    kept = rescue.copy_state([iter(live.items())] * 3, copy=False)
    assert np.shares_memory(kept[0]["w"], live["w"])  # MLX's arrays never change: a view is the step's state


def test_a_restart_line_gives_the_ranks_own_words_and_none_for_a_death(tmp_path):
    cfg = RunConfig(preset="tiny", nproc=2, max_restarts=2)
    rows(tmp_path / "metrics.jsonl", range(1, 3))
    restarts = Restarts(cfg)
    failed = {"failed_rank": 1, "cause": "failed",
              "error": "rank 1 failed in step 3: RuntimeError: [ring] could not reach 10.0.0.1\nTraceback ..."}
    nxt = restarts.after_failure(cfg, failed, tmp_path, time.time(), {}, None)
    restarts.after_failure(nxt, died(3), tmp_path, time.time(), {}, None)
    first, second = (restart_line(record, 2) for record in restarts.records)
    assert first.startswith("restart 1/2: rank 1 failed in step 3 (RuntimeError: [ring] could not reach 10.0.0.1); ")
    assert second.startswith("restart 2/2: rank 1 died in step 3; ")


def hostfile_config(tmp_path, hosts, *, form="list", **fields) -> RunConfig:
    """An MLX ring job over `hosts` (ssh names), 5 steps done, a checkpoint at step 4."""
    entries = [{"ssh": h, "ips": [f"10.0.0.{i + 1}"]} for i, h in enumerate(hosts)]
    data = {"backend": "ring", "envs": ["A=1"], "hosts": entries} if form == "object" else entries
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps(data))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rows(run_dir / "metrics.jsonl", range(1, 6))
    checkpoint_at(run_dir, 4)
    return RunConfig(**{"preset": "tiny", "framework": "mlx", "backend": "ring", "nproc": len(hosts),
                        "global_batch_size": 8, "hostfile": str(path), "max_restarts": 1, **fields})


def asked(monkeypatch, *answers):
    """Each probe of the hosts returns the next of `answers` (the hosts that do not answer, with why)."""
    calls = []

    def probe(hosts, timeout_s):
        calls.append([h["ssh"] for h in hosts])
        return answers[min(len(calls), len(answers)) - 1]

    monkeypatch.setattr("compare.launch.restarts.unanswered", probe)
    return calls


@pytest.mark.parametrize("form", ["list", "object"])
def test_with_min_nproc_a_hostfile_job_goes_on_with_the_hosts_that_answer(form, tmp_path, monkeypatch):
    cfg = hostfile_config(tmp_path, ["mac1", "mac2"], form=form, min_nproc=1)
    user_file = Path(cfg.hostfile).read_text()
    asked(monkeypatch, {"mac2": "no answer within 5 s"})
    restarts = Restarts(cfg)
    nxt = restarts.after_failure(cfg, died(5), tmp_path / "run", time.time(), {}, None)
    assert (nxt.nproc, nxt.grad_accum, nxt.resume) == (1, 2, True)
    assert nxt.hostfile == str(tmp_path / "run" / RESTART_HOSTFILE)
    written = json.loads(Path(nxt.hostfile).read_text())
    hosts = written["hosts"] if form == "object" else written
    assert [h["ssh"] for h in hosts] == ["mac1"]
    if form == "object":  # the user's backend and envs go on with the hosts
        assert (written["backend"], written["envs"]) == ("ring", ["A=1"])
    assert Path(cfg.hostfile).read_text() == user_file, "the user's hostfile is never overwritten"
    record = restarts.records[0]
    assert (record["hosts_skipped"], record["hostfile_after"], record["nproc_after"]) == (["mac2"], nxt.hostfile, 1)
    assert "shrank 2 -> 1 ranks (grad accum 2, same global batch)" in restart_line(record, 1)


def test_a_local_host_left_alone_goes_on_as_one_plain_process(tmp_path, monkeypatch):
    cfg = hostfile_config(tmp_path, ["127.0.0.1", "mac2"], min_nproc=1)
    asked(monkeypatch, {"mac2": "Connection timed out"})
    nxt = Restarts(cfg).after_failure(cfg, died(5), tmp_path / "run", time.time(), {}, None)
    assert (nxt.nproc, nxt.hostfile, nxt.grad_accum) == (1, "", 2)


def test_when_every_host_answers_the_hostfile_job_restarts_as_it_was(tmp_path, monkeypatch):
    cfg = hostfile_config(tmp_path, ["mac1", "mac2"], min_nproc=1)
    calls = asked(monkeypatch, {})
    restarts = Restarts(cfg)
    nxt = restarts.after_failure(cfg, died(5), tmp_path / "run", time.time(), {}, None)
    assert nxt == cfg.replace(resume=True) and calls == [["mac1", "mac2"]]
    assert restarts.records[0]["hosts_skipped"] is None and not (tmp_path / "run" / RESTART_HOSTFILE).exists()


def test_fewer_hosts_answering_than_min_nproc_end_the_job_in_one_line(tmp_path, monkeypatch):
    cfg = hostfile_config(tmp_path, ["mac1", "mac2", "mac3"], min_nproc=2, global_batch_size=12)
    asked(monkeypatch, {"mac2": "no answer within 5 s", "mac3": "no route to host"})
    failure = died(5)
    assert Restarts(cfg).after_failure(cfg, failure, tmp_path / "run", time.time(), {}, None) is None
    assert "[not restarted: 1 of 3 hosts answer, --min-nproc 2; not answering: mac2 (no answer" in failure["error"]
    assert "\n" not in failure["error"]


def test_without_min_nproc_the_restart_waits_for_the_host_and_ends_in_one_line_after_the_timeout(
        tmp_path, monkeypatch, capsys):
    cfg = hostfile_config(tmp_path, ["mac1", "mac2"])
    monkeypatch.setenv(HOST_WAIT_ENV, "0.3")
    monkeypatch.setattr("compare.launch.restarts.HOST_POLL_S", 0.05)
    calls = asked(monkeypatch, {"mac2": "no answer within 5 s"})
    failure, started = died(5), time.time()
    assert Restarts(cfg).after_failure(cfg, failure, tmp_path / "run", time.time(), {}, None) is None
    assert 0.3 <= time.time() - started < 3 and len(calls) > 2  # asked again while it waited
    assert f"host mac2 of {cfg.hostfile} did not answer within 0.3 s" in failure["error"]
    assert "\n" not in failure["error"]
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("dpcompare: waiting up to 0.3 s") and "mac2 (no answer within 5 s)" in line
    assert line in (tmp_path / "run" / "log.txt").read_text()


def test_without_min_nproc_a_host_that_answers_again_gets_the_job_back_at_its_size(tmp_path, monkeypatch):
    cfg = hostfile_config(tmp_path, ["mac1", "mac2"])
    monkeypatch.setenv(HOST_WAIT_ENV, "30")
    monkeypatch.setattr("compare.launch.restarts.HOST_POLL_S", 0.01)
    asked(monkeypatch, {"mac2": "no answer"}, {"mac2": "no answer"}, {})
    nxt = Restarts(cfg).after_failure(cfg, died(5), tmp_path / "run", time.time(), {}, None)
    assert nxt == cfg.replace(resume=True)


@pytest.mark.parametrize("value", ["soon", "-1", "inf", "nan"])
def test_a_bad_host_wait_is_refused_in_one_line(value, monkeypatch):
    monkeypatch.setenv(HOST_WAIT_ENV, value)
    with pytest.raises(UserError, match=f"{HOST_WAIT_ENV}='{value}': expected the seconds"):
        host_wait_s()


def test_a_host_answers_when_ssh_runs_true_there(tmp_path, monkeypatch):
    fake = tmp_path / "ssh"  # `ssh ... HOST true`: up answers, down says why as ssh would
    fake.write_text('#!/bin/sh\nfor a; do host=$prev; prev=$a; done\n'
                    '[ "$host" = up ] && exit 0\necho "ssh: connect to host $host port 22: Connection timed out" >&2\n'
                    'exit 255\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    hosts = [{"ssh": h} for h in ("127.0.0.1", "up", "down", "down")]
    assert unanswered(hosts, 1) == {"down": "ssh: connect to host down port 22: Connection timed out"}


def test_a_jaccl_hostfile_shrinks_to_the_rdma_devices_between_the_hosts_kept(tmp_path, monkeypatch):
    cfg = hostfile_config(tmp_path, ["mac1", "mac2", "mac3"], min_nproc=2, global_batch_size=12)
    path = Path(cfg.hostfile)
    rdma = [[None, "en2", "en3"], ["en1", None, "en3"], ["en1", "en2", None]]
    path.write_text(json.dumps({"backend": "jaccl", "hosts": [{"ssh": f"mac{i + 1}", "ips": [f"10.0.0.{i + 1}"],
                                                               "rdma": rdma[i]} for i in range(3)]}))
    asked(monkeypatch, {"mac2": "no answer within 5 s"})
    nxt = Restarts(cfg).after_failure(cfg, died(5), tmp_path / "run", time.time(), {}, None)
    written = json.loads(Path(nxt.hostfile).read_text())
    assert nxt.nproc == 2 and written["backend"] == "jaccl"
    assert [(h["ssh"], h["rdma"]) for h in written["hosts"]] == [("mac1", [None, "en3"]), ("mac3", ["en1", None])]


OOM_LOG = ("[46082.504447] oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),cpuset=/,mems_allowed=0,global_oom\n"
           "[46082.504517] Out of memory: Killed process 23006 (python) total-vm:14925624kB, anon-rss:12241548kB, "
           "file-rss:24kB, shmem-rss:0kB, UID:0 pgtables:24268kB oom_score_adj:0\n")


def test_the_kernels_out_of_memory_line_names_the_rank_only_when_it_is_recent():
    from compare.machine.oom import killed_rss

    assert killed_rss(OOM_LOG, 23006, now_s=46090.0) == 12241548 * 1024
    assert killed_rss(OOM_LOG, 23005, now_s=46090.0) is None          # another pid
    assert killed_rss(OOM_LOG, 23006, now_s=46082.5 + 3600) is None   # the same pid, reused an hour later


def test_a_rank_the_kernel_killed_for_memory_is_named_so_and_never_restarted(monkeypatch, tmp_path):
    from compare.launch import watchdog

    monkeypatch.setattr(watchdog, "process_state", lambda pid: None)   # the rank's process is gone
    monkeypatch.setattr(watchdog, "oom_killed", lambda pid: 12.2e9 if pid == 4242 else None)
    ranks = {0: {"rank": 0, "pid": 4241, "step": 0, "status": "running"},
             1: {"rank": 1, "pid": 4242, "step": 0, "status": "running"}}
    failure = watchdog.diagnose({1: ranks[1]}, [1], True, None)
    assert failure["cause"] == "out of memory" and "out-of-memory killer in step 1, at 12.2 GB" in failure["error"]
    assert watchdog.diagnose({0: ranks[0]}, [0], True, None)["cause"] == "died"   # a signal, not the kernel
    cfg = RunConfig(preset="tiny", nproc=2, max_restarts=2)
    assert Restarts(cfg).after_failure(cfg, failure, tmp_path, time.time(), {}, None) is None
    assert "killed again at every restart" in failure["error"]
