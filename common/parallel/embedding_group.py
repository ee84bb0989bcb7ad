"""Tied embeddings under pipeline parallelism: Megatron-LM's "embedding group", framework-neutral.

A tied model (model.tie_embeddings, HF's tie_word_embeddings: Llama 3.2 1B and 3B, SmolLM2) has one matrix,
`model.embed_tokens.weight`, used twice: the first stage looks the tokens up in it, the last stage multiplies
the final hidden states by it (the output head). Megatron-LM's way, which mlx_impl/pp.py and torch_impl/pp.py
follow:

    hold       the first and the last stage each hold a copy, both read from the same seeded (or loaded)
               tensor, so they are equal at the start
    sum        every step, after the backward and before the norm, the two copies' gradients are summed over
               the group (first + last stage): each then holds the whole gradient (lookup + head), the one a
               single rank computes, and AdamW updates both copies identically, so they stay equal
    count once the global gradient norm and the checkpoints count the first stage's copy only: HF files hold
               `model.embed_tokens.weight` once, as tied checkpoints do, and a sharded index lists one piece

With 2 stages the group is the whole pipeline. With more, the middle stages are not in it: the group is a
communicator of the two ranks, torch's `dist.new_group` (which every rank of the job builds for every pipeline,
in one order: `job_groups`), MLX's `Group.split` of the pipeline's group on the backends that split (MPI, nccl).
MLX's ring backend cannot split a group (FACTS.md), so there MLX sums over the whole pipeline and the middle
stages add zeros (exact: x + 0 = x), at (p - 1) / p x 2 V d x 4 bytes on every rank instead of V d x 4 on two.
Its cost beside the activations: one all-reduce of V x dim float32 per optimizer step (common/parallel/pp.py
counts it), and the last stage holds V x dim more weights, gradients and AdamW moments.

`EmbeddingGroup` speaks of stages; `ranks` maps them to the ranks of a job, so a mesh (pp beside other axes)
has one group per pipeline, from each pipeline's own stage-to-rank map (`job_groups`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from common.model.spec import ModelSpec
from common.parallel.mesh import Mesh

TIED_MATRIX = "model.embed_tokens.weight"
TIED_BYTES_PER_ELEMENT = 4  # the gradient is summed in float32, the master dtype, whatever --dtype


@dataclass(frozen=True)
class EmbeddingGroup:
    """The stages that hold the tied matrix, first then last; empty for an untied model or one stage."""
    stages: tuple[int, ...]
    n_stages: int
    names: tuple[str, ...] = (TIED_MATRIX,)

    @classmethod
    def of(cls, spec: ModelSpec, n_stages: int) -> EmbeddingGroup:
        return cls((0, n_stages - 1) if spec.tie_embeddings and n_stages > 1 else (), n_stages)

    @property
    def tied(self) -> bool:
        return bool(self.stages)

    def holds(self, name: str, stage: int) -> bool:
        """`stage` holds a copy of the tied tensor `name`."""
        return name in self.names and stage in self.stages

    def counts(self, name: str, stage: int) -> bool:
        """Whether `stage`'s copy of `name` counts where the model is counted once (the global norm, the
        checkpoints): every tensor but the last stage's copy of the tied matrix."""
        return not (name in self.names and self.stages and stage != self.stages[0])

    @property
    def spans_pipeline(self) -> bool:
        """Every stage is in the group (2 stages): the pipeline's own group sums the gradient."""
        return len(self.stages) == self.n_stages

    def ranks(self, rank_of_stage: Callable[[int], int] = lambda stage: stage) -> list[int]:
        """The group's ranks, given where each stage runs (one-axis pp: stage s is rank s; on a mesh, the ranks
        of one pipeline)."""
        return [rank_of_stage(stage) for stage in self.stages]

    def job_groups(self, mesh: Mesh) -> list[list[int]]:
        """The embedding group of every pipeline of the job, as ranks: one per group of the mesh's pp axis (one
        for one-axis pp; on `--mesh dp=2,pp=3`, [0, 4] and [1, 5]), in the order of `Mesh.groups`, the one order
        in which every rank builds them (torch's new_group is called by every rank, for every group, in order)."""
        return [self.ranks(pipeline.__getitem__) for pipeline in mesh.groups("pp")]

    def elements(self, spec: ModelSpec) -> int:
        """Elements of the tied matrix (what the last stage holds beyond its own blocks), 0 when untied."""
        return spec.vocab_size * spec.dim if self.tied else 0

    def gradient_bytes(self, spec: ModelSpec) -> int:
        """One step's all-reduce payload over the group: the tied gradient in float32."""
        return self.elements(spec) * TIED_BYTES_PER_ELEMENT
