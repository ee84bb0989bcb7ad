"""One pipeline stage's bookkeeping, framework-neutral: the blocks and tensors the stage holds, its idle time in
each training step (the measured bubble), what its status file records, and the gather of the whole state from
every stage's own tensors. mlx_impl/pp.py and torch_impl/pp.py build their `Pipeline` on it; the split and the
schedules are pipeline.py's.

The bubble: every training step runs between two barriers, so all stages see the same window; the time a stage
spends in its own forward and backward computations inside that window is its busy time, and 1 - busy / window
its measured idle fraction, reported beside the analytic (p - 1) / (M + p - 1).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator, Mapping, TypeVar

import numpy as np

from common.checkpoint.tensorsource import Index
from common.config import RunConfig
from common.model.spec import ModelSpec
from common.model.weights import parameter_shapes
from common.parallel.embedding_group import TIED_MATRIX, EmbeddingGroup
from common.parallel.pipeline import bubble_fraction, stage_holds, stage_layers
from common.train.rank_checks import TrainingError

ArrayT = TypeVar("ArrayT")


class BusyClock:
    """The seconds a stage computes inside one step's window."""

    def __init__(self) -> None:
        self.busy_s = 0.0

    @contextmanager
    def busy(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.busy_s += time.perf_counter() - start


class StageBookkeeping:
    """This rank's stage (one per rank): which blocks and tensors it holds, and its measured idle fractions."""

    def __init__(self, cfg: RunConfig, stage: int, n_stages: int):
        self.stage, self.n_stages = stage, n_stages
        self.mesh = cfg.layout.mesh  # the job's ranks: one pp axis, or pp beside others (the embedding groups')
        self.first, self.last = stage == 0, stage == n_stages - 1
        self.n_micro, self.schedule = cfg.pp_pieces, cfg.pp_schedule
        self.idle: list[float] = []  # per training step: this stage's measured idle fraction

    def place(self, spec: ModelSpec) -> None:
        """The stage's blocks of `spec` (`layers`), the global shapes of every tensor of the model, and the
        embedding group (the first and last stage when the embeddings are tied)."""
        self.n_layers, self.layers = spec.n_layers, stage_layers(spec.n_layers, self.n_stages, self.stage)
        self.shapes = parameter_shapes(spec)
        self.embedding = EmbeddingGroup.of(spec, self.n_stages)
        self.holds_embedding = self.first or self.embedding.holds(TIED_MATRIX, self.stage)

    def holds(self, name: str) -> bool:
        return stage_holds(name, self.n_layers, self.stage, self.embedding)

    def counts(self, name: str) -> bool:
        """This stage's copy of `name` counts in the global norm and the checkpoints: the tied matrix counts on
        the first stage only (EmbeddingGroup.counts)."""
        return self.embedding.counts(name, self.stage)

    def local_index(self, name: str, shape: tuple[int, ...]) -> Index | None:
        """A stage keeps its own tensors whole and nothing of the others'."""
        return () if self.holds(name) else None

    def counted(self, named: Mapping[str, ArrayT]) -> dict[str, ArrayT]:
        """The tensors of `named` that count on this stage (`counts`): what its sharded checkpoint writes."""
        return {name: value for name, value in named.items() if self.counts(name)}

    @contextmanager
    def step_window(self, barrier: Callable[[], None], instrumented: bool) -> Iterator[BusyClock]:
        """One training step between two barriers; the stage adds its computations to the clock it is given.
        The time breakdown's instrumented steps wait after every phase, which is no bubble: not recorded."""
        barrier()
        start, clock = time.perf_counter(), BusyClock()
        yield clock
        barrier()
        window = time.perf_counter() - start
        if not instrumented:
            self.idle.append(max(0.0, 1.0 - clock.busy_s / window) if window > 0 else 0.0)

    def gather(self, named: Mapping[str, ArrayT], all_sum: Callable[[ArrayT | None, tuple[int, ...]], np.ndarray],
               as_numpy: Callable[[ArrayT], np.ndarray]) -> Iterator[tuple[str, np.ndarray]]:
        """The whole model's tensors on every rank, one at a time from each stage's own: `all_sum(tensor, shape)`
        sums this stage's tensor (None: a stage that does not hold it gives zeros, and x + 0 is exact) over the
        stages. A tied matrix comes from the first stage's copy; the last stage checks that its own copy is the
        same (`as_numpy` reads it), so a checkpoint never hides copies that drifted apart. Every rank calls it:
        collectives, in one order."""
        for name, shape in self.shapes.items():
            whole = all_sum(named[name] if self.holds(name) and self.counts(name) else None, shape)
            if self.holds(name) and not self.counts(name):
                mine = as_numpy(named[name])
                if not np.array_equal(mine, whole):
                    raise TrainingError(
                        f"stage {self.stage}'s copy of the tied {name} differs from the first stage's by up to "
                        f"{float(np.max(np.abs(mine - whole))):.3g} after the step: the embedding group's gradient "
                        "sum failed; not saving (the last checkpoint is kept)")
            yield name, whole

    def figures(self) -> dict[str, object]:
        """The bubble: this stage's median idle fraction over the steps after the first (compilation, warm caches,
        torch's shape inference; the time breakdown's uninstrumented steps count too), beside the analytic
        value; and what the stage held."""
        steady = self.idle[1:] or self.idle
        return {"pp_bubble": float(np.median(steady)) if steady else None,
                "pp_bubble_analytic": bubble_fraction(self.n_stages, self.n_micro),
                "pp_schedule": self.schedule, "pp_microbatches": self.n_micro,
                "pp_layers": [self.layers.start, self.layers.stop],
                "pp_tied_embedding_stages": list(self.embedding.stages)}
