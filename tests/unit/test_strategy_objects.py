"""Each strategy is one object in common/parallel/ (common/parallel/layout.py's Layout), registered once in
STRATEGIES: the config, the summary's estimate and the cost model ask it, so a new strategy needs no edit to
any of them, and nothing in common/ tests a strategy's name."""
import ast
import inspect
import math
from pathlib import Path

import pytest
from costmodel_fixtures import SPEC, link_record, summary

from common.config import RunConfig
from common.costmodel.calibrate import calibrate
from common.costmodel.links import Collective, Link, link_from_record
from common.costmodel.memory import predicted_peak
from common.costmodel.predict import predict
from common.costmodel.workload import Workload
from common.errors import UserError
from common.model.spec import ModelSpec, preset
from common.parallel import STRATEGIES, comm_bytes_per_step_estimate, layout
from common.parallel.fsdp import reduce_scatter_kind, reduce_scatter_traffic
from common.parallel.layout import MASTER_BYTES, Layout, total_parameters
from common.parallel.mesh import Mesh

ROOT = Path(__file__).resolve().parents[2]
TINY = ModelSpec.from_dict(SPEC)


class HalvedLayout(Layout):
    """A made-up strategy: each rank holds and computes half, and makes three all-gathers of 1 MB a step."""
    name = "halved"

    def local_parameters(self, spec, framework="torch"):
        return total_parameters(spec) / self.ranks

    def work_fraction(self, w):
        return 1.0 / self.ranks

    def step_collectives(self, w, reduce_scatter):
        return [Collective("all_gather", 1_000_000, 3, "made-up gathers")]

    def payload_bytes_per_step(self, spec, micro_batch_size, seq_len, grad_accum, dtype):
        return 3_000_000

    def streamed_checkpoint_bytes(self, w, rank):
        return 0.0


@pytest.fixture
def halved(monkeypatch):
    monkeypatch.setitem(STRATEGIES, "halved", HalvedLayout)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_registered_strategy_is_a_whole_layout_that_answers_for_a_real_model(name):
    cls = STRATEGIES[name]
    assert issubclass(cls, Layout) and cls.name == name and not inspect.isabstract(cls)
    lay = layout(name, 2)
    lay.check(TINY)
    w = Workload(TINY, 128, 32, grad_accum=2, pp_microbatches=4)
    assert 0 < lay.work_fraction(w) <= 1 and 0 < lay.state_fraction(w) <= 1
    assert [lay.data_parallel(r)[1] for r in (0, 1)] == [lay.dp_size] * 2
    colls = lay.collectives(w)
    assert colls and all(isinstance(c, Collective) and c.nbytes > 0 and c.calls > 0 for c in colls)
    assert layout(name, 1).collectives(w) == [] and layout(name, 1).comm_bytes_per_step_estimate(TINY, 16, 128, 2) == 0
    estimate = lay.comm_bytes_per_step_estimate(TINY, 16 // lay.dp_size, 128, 2)
    assert estimate is None or estimate > 0
    assert lay.activation_bytes(w) > 0 and lay.gathered_bytes(w) >= 0 and lay.checkpoint_bytes(w) >= 0


def test_a_layout_that_leaves_out_part_of_the_protocol_cannot_be_made():
    class NoCollectives(Layout):
        name = "partial"

        def local_parameters(self, spec, framework="torch"):
            return 1.0

        def work_fraction(self, w):
            return 1.0

    with pytest.raises(TypeError, match="step_collectives"):
        NoCollectives(Mesh.one_axis("partial", 2))


def test_a_strategy_registered_once_is_predicted_calibrated_estimated_and_configured(halved):
    cal = calibrate(summary("torch", 1), TINY)
    link = Link.wire(1, 100)
    p = predict(cal, "halved", 2, link)
    assert [(c.kind, c.nbytes, c.calls) for c in p.collectives] == [("all_gather", 1_000_000, 3)]
    assert p.comm_s == pytest.approx(3 * link.all_gather_s(1e6, 2)) and p.exposed_comm_s == pytest.approx(p.comm_s)
    assert p.compute_s == pytest.approx((cal.forward_s + cal.backward_s + cal.optimizer_s) / 2 + cal.other_s)
    assert p.memory_bytes["params"] == pytest.approx(MASTER_BYTES * total_parameters(TINY) / 2)
    w = cal.workload
    assert predicted_peak("halved", w, 2, 3e8)["params"] == p.memory_bytes["params"]
    assert comm_bytes_per_step_estimate("halved", TINY, 2, 16, 128, 1) == 3_000_000
    # A calibration run of the made-up strategy: its collectives are taken off the measured step, and the
    # prediction at the same point puts them back.
    s = {**summary("torch", 2, "halved", link=link_record("1gbit")), "strategy": "halved"}
    own = predict(calibrate(s, TINY), "halved", 2, link_from_record(s["link"]))
    assert own.step_s == pytest.approx(s["step_time_s"], rel=1e-9)
    cfg = RunConfig(strategy="halved", nproc=2, global_batch_size=8)
    cfg.validate()
    assert cfg.data_parallel_size == 2 and cfg.micro_batch_size == 4


def test_the_registry_refuses_an_unknown_name_in_one_message():
    for call in (lambda: layout("zero", 2), lambda: predict(calibrate(summary("mlx", 1), TINY), "zero", 2, None),
                 lambda: RunConfig(strategy="zero").validate()):
        with pytest.raises(UserError, match="allowed: ddp, fsdp, tp, pp"):
            call()


def test_the_summary_estimate_and_the_collectives_come_from_one_object_and_agree():
    """tp: the estimate is its collectives' payload; ddp: the gradients its buckets cut (each rounded down by
    under a byte); pp: what the first stage sends, one direction of its boundary's collectives."""
    for spec in (TINY, preset("small")):
        for strategy, n in (("ddp", 2), ("tp", 2), ("pp", 2), ("ddp", 4), ("tp", 4)):
            lay = layout(strategy, n)
            w = Workload(spec, 128, 8 * lay.dp_size * 2, grad_accum=2, dtype="bfloat16", framework="mlx")
            payload = sum(c.nbytes * c.calls for c in lay.collectives(w))
            estimate = lay.comm_bytes_per_step_estimate(spec, 8, 128, 2, "bfloat16")
            if strategy == "ddp":
                calls = sum(c.calls for c in lay.collectives(w))
                assert estimate - calls < payload <= estimate
            else:
                assert payload == estimate * (2 if strategy == "pp" else 1)


def test_no_module_in_common_compares_a_strategy_name_with_a_literal():
    def is_strategy(node):
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
        return "strategy" in name.lower()

    def is_literal(node):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(is_literal(e) for e in node.elts)
        return isinstance(node, ast.Constant) and isinstance(node.value, str)

    found = []
    for path in sorted((ROOT / "common").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(is_strategy(a) for a in sides) and any(is_literal(a) for a in sides):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found


def test_a_mesh_names_its_axes_outermost_first():
    mesh = Mesh((("dp", 2), ("tp", 3)))
    assert (mesh.size, mesh.axis("dp"), mesh.axis("tp"), mesh.names) == (6, 2, 3, ("dp", "tp"))
    assert [(mesh.coordinate(r, "dp"), mesh.coordinate(r, "tp")) for r in range(6)] == \
        [(d, t) for d in range(2) for t in range(3)]
    one = Mesh.one_axis("fsdp", 4)
    assert (one.size, one.axis("fsdp"), math.prod(s for _, s in one.axes)) == (4, 4, 4)
    assert layout("fsdp", 4).mesh == one and layout("fsdp", 4).ranks == 4
    with pytest.raises(KeyError):
        one.axis("tp")
    for bad in ((), (("dp", 2), ("dp", 2)), (("dp", 0),)):
        with pytest.raises(ValueError):
            Mesh(bad)


def test_one_reduce_scatter_kind_says_what_each_framework_runs_and_what_it_moves():
    # what the backends run and summary.json reports (tests/integration/test_fsdp.py checks the runs)
    assert [reduce_scatter_kind("mlx", b) for b in ("ring", "mpi", "nccl")] == ["all_sum_slice", "all_sum_slice", "native"]
    assert [reduce_scatter_kind("torch", b) for b in ("gloo", "nccl")] == ["native", "native"]
    # what the cost model charges: gloo's native reduce_scatter_tensor moves an all-reduce's bytes
    assert [reduce_scatter_traffic("torch", b) for b in ("gloo", "nccl")] == ["all_sum_slice", "native"]
    assert reduce_scatter_traffic("mlx", "ring") == "all_sum_slice" and reduce_scatter_traffic("mlx", "nccl") == "native"
