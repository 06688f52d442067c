"""Between the engine and a family's ``forward_batch``: cache reservation, the step's batch,
CUDA-graph choice and replay (:mod:`metrale.runner.runner`, :mod:`metrale.runner.graphs`), and
token sampling (:mod:`metrale.runner.sampling`)."""

from metrale.runner.runner import ModelRunner
from metrale.runner.sampling import TokenSampler, new_sampler

__all__ = ["ModelRunner", "TokenSampler", "new_sampler"]
