"""Tied embeddings under pipeline parallelism, without starting ranks: the embedding group (first and last
stage), what each stage holds and counts, the gather that writes one copy and refuses copies that drifted, and
the estimate's extra all-reduce and memory (common/parallel/embedding_group.py, common/parallel/pp.py)."""
import math

import numpy as np
import pytest

from common.config import RunConfig
from common.costmodel.links import Link
from common.costmodel.workload import Workload
from common.model.spec import preset
from common.model.weights import parameter_shapes
from common.parallel import comm_bytes_per_step_estimate, layout
from common.parallel.embedding_group import TIED_MATRIX, EmbeddingGroup
from common.parallel.mesh import Mesh
from common.parallel.pipeline import stage_holds
from common.parallel.pipeline_stage import StageBookkeeping
from common.train.rank_checks import TrainingError

TIED = preset("tiny").with_(tie_embeddings=True, n_layers=4)


def test_the_embedding_group_is_the_first_and_last_stage_of_a_tied_model_only():
    assert EmbeddingGroup.of(TIED, 2).stages == (0, 1) and EmbeddingGroup.of(TIED, 2).spans_pipeline
    four = EmbeddingGroup.of(TIED, 4)
    assert four.stages == (0, 3) and not four.spans_pipeline
    assert four.ranks(lambda stage: 10 + 2 * stage) == [10, 16]  # a pipeline of a mesh: its own stage -> rank map
    assert EmbeddingGroup.of(TIED.with_(tie_embeddings=False), 4).stages == ()
    assert EmbeddingGroup.of(TIED, 1).stages == ()
    assert four.counts(TIED_MATRIX, 0) and not four.counts(TIED_MATRIX, 3) and four.counts("model.norm.weight", 3)
    assert four.gradient_bytes(TIED) == TIED.vocab_size * TIED.dim * 4


def test_every_pipeline_of_a_mesh_has_its_own_embedding_group_of_its_two_ends():
    three = EmbeddingGroup.of(TIED, 3)
    # pp outermost: pipeline i is ranks i, i + 2, i + 4 (common/parallel/mesh.py); its ends are stages 0 and 2
    assert three.job_groups(Mesh.parse("dp=2,pp=3")) == [[0, 4], [1, 5]]
    assert three.job_groups(Mesh.one_axis("pp", 3)) == [[0, 2]]  # one-axis pp: the job's one pipeline
    four = EmbeddingGroup.of(TIED, 4).job_groups(Mesh.parse("pp=4,dp=3"))
    assert four == [[0, 9], [1, 10], [2, 11]]
    # each group's ranks are the first and the last stage of one pipeline, and no rank is in two groups
    mesh = Mesh.parse("pp=4,dp=3")
    assert [(mesh.coordinate(a, "pp"), mesh.coordinate(b, "pp")) for a, b in four] == [(0, 3)] * 3
    assert len({r for g in four for r in g}) == 2 * 3
    # a mesh's check takes a tied model over more than 2 stages (it used to refuse it)
    layout("mesh", 6, "dp=2,pp=3").check(TIED)
    assert StageBookkeeping(RunConfig.from_dict({"preset": "tiny", "nproc": 6, "mesh": "dp=2,pp=3",
                                                 "model": {"n_layers": 3}}), 1, 3).mesh == Mesh.parse("dp=2,pp=3")


def test_with_tied_embeddings_the_last_stage_also_holds_the_matrix_and_every_other_tensor_one_stage():
    group = EmbeddingGroup.of(TIED, 3)
    holders = {name: [s for s in range(3) if stage_holds(name, TIED.n_layers, s, group)]
               for name in parameter_shapes(TIED)}
    assert "lm_head.weight" not in holders and holders[TIED_MATRIX] == [0, 2]
    assert all(len(stages) == 1 for name, stages in holders.items() if name != TIED_MATRIX)
    assert holders["model.norm.weight"] == [2] and holders["model.layers.2.mlp.up_proj.weight"] == [1]


def _stage(stage: int, n_stages: int = 2) -> StageBookkeeping:
    cfg = RunConfig.from_dict({"strategy": "pp", "nproc": n_stages, "model": {"n_layers": TIED.n_layers}})
    book = StageBookkeeping(cfg, stage, n_stages)
    book.place(TIED)
    return book


def _stage_state(book: StageBookkeeping, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in book.shapes.items()
            if book.holds(name)}


def _gather_both(states: list[dict], books: list[StageBookkeeping]) -> list[dict]:
    """Every stage's gather, with the all-sum written out: the other stages' contributions added to this one's."""
    contributed: dict = {}
    for book, state in zip(books, states):  # what each stage hands to the all-sum, recorded by a first pass
        def record(value, shape, book=book):
            contributed.setdefault(book.stage, []).append(np.zeros(shape, np.float32) if value is None else value)
            return np.zeros(shape, np.float32)
        list(book.gather(state, record, np.zeros_like))  # zeros: the sums this pass returns, so nothing differs
    totals = [sum(parts) for parts in zip(*(contributed[b.stage] for b in books))]
    out = []
    for book, state in zip(books, states):
        sums = iter(totals)
        out.append(dict(book.gather(state, lambda value, shape: next(sums), np.asarray)))
    return out


def test_the_gather_writes_the_first_stages_copy_once_and_refuses_copies_that_drifted_apart():
    books = [_stage(0), _stage(1)]
    first = _stage_state(books[0])
    last = {**_stage_state(books[1], seed=1), TIED_MATRIX: first[TIED_MATRIX].copy()}
    gathered = _gather_both([first, last], books)
    assert gathered[0].keys() == gathered[1].keys() == set(parameter_shapes(TIED))
    np.testing.assert_array_equal(gathered[1][TIED_MATRIX], first[TIED_MATRIX])  # once, not twice
    np.testing.assert_array_equal(gathered[0]["model.norm.weight"], last["model.norm.weight"])
    last[TIED_MATRIX][3, 5] += 1e-6
    with pytest.raises(TrainingError, match="tied model.embed_tokens.weight differs"):
        _gather_both([first, last], books)


def test_each_stage_counts_its_own_tensors_and_only_the_first_the_tied_matrix():
    books = [_stage(s, 3) for s in range(3)]
    counted = [sorted(n for n in b.shapes if b.holds(n) and b.counts(n)) for b in books]
    assert sorted(sum(counted, [])) == sorted(parameter_shapes(TIED))  # the norm counts every tensor once
    assert books[2].holds(TIED_MATRIX) and not books[2].counts(TIED_MATRIX)
    assert [b.holds_embedding for b in books] == [True, False, True]
    assert books[1].figures()["pp_tied_embedding_stages"] == [0, 2]


def test_the_estimate_adds_the_tied_gradients_all_reduce_and_the_last_stages_copy():
    untied = TIED.with_(tie_embeddings=False)
    tied_bytes = TIED.vocab_size * TIED.dim * 4
    # one step: global batch 8 (micro-batch 4 x accum 2), seq 32: the first stage's activations, plus the tied sum
    assert (comm_bytes_per_step_estimate("pp", TIED, 2, 4, 32, 2)
            == comm_bytes_per_step_estimate("pp", untied, 2, 4, 32, 2) + tied_bytes)
    pp = layout("pp", 4)
    shapes = parameter_shapes(TIED)
    last = sum(math.prod(shapes[f"model.layers.3.{k}"]) for k in
               [n.split("model.layers.3.")[1] for n in shapes if n.startswith("model.layers.3.")])
    assert pp.local_parameters(TIED) == last + TIED.dim + TIED.vocab_size * TIED.dim  # block, norm, the copy
    w = Workload(TIED, 8, 32, grad_accum=2, pp_microbatches=4)
    sends, tied = pp.collectives(w)
    assert (tied.kind, tied.nbytes, tied.calls) == ("all_reduce", tied_bytes, 1)
    assert [c.kind for c in pp.collectives(Workload(untied, 8, 32, grad_accum=2, pp_microbatches=4))] == ["send"]

    class Cal:  # a calibration's fields the exposed-communication rule reads
        workload, forward_s, backward_s, overlap, sync_overhead_s, on_cpu, cores_shared_by = w, 0.01, 0.02, None, 0.0, True, 1.0
        backend = "gloo"

    link = Link.wire(1.0, 100.0)
    untied_cal = type("U", (Cal,), {"workload": Workload(untied, 8, 32, grad_accum=2, pp_microbatches=4)})
    extra = (pp.exposed_comm_s(Cal(), [sends, tied], link, 0.0)
             - pp.exposed_comm_s(untied_cal(), [sends], link, 0.0))
    assert extra == pytest.approx(link.all_reduce_s(tied_bytes, 2))  # on the critical path, between 2 ranks
