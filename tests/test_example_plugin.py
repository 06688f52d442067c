"""The example third-party family is found through its entry point and runs a forward."""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

import pytest

from metrale import LLM, SamplingParams
from metrale.model.family import resolve_family
from metrale.model.plugin_manager import get_plugin_manager

EXAMPLE_TESTS = Path(__file__).resolve().parents[1] / "examples" / "metrale-example-family" / "tests"


@pytest.fixture(scope="module")
def example_checkpoint(tmp_path_factory):
    sys.path.insert(0, str(EXAMPLE_TESTS))
    try:
        from reference import build_checkpoint
    finally:
        sys.path.remove(str(EXAMPLE_TESTS))
    return build_checkpoint(tmp_path_factory.mktemp("parallel_block"))


def test_example_is_installed_as_an_entry_point():
    found = {ep.name: ep for ep in metadata.entry_points(group="metrale")}
    assert "parallel_block" in found, (
        "the example plugin is not installed: pip install ./examples/metrale-example-family "
        "(the README's test command does this)"
    )
    assert found["parallel_block"].dist.name == "metrale-example-family"


def test_example_is_registered_and_resolved_from_architectures(example_checkpoint):
    import json

    manager = get_plugin_manager()
    assert manager.distributions.get("parallel_block") == "metrale-example-family"
    config = json.loads((example_checkpoint / "config.json").read_text())
    assert resolve_family(manager, config).name == "parallel_block"
    assert resolve_family(manager, {"architectures": config["architectures"]}).name == "parallel_block"


def test_example_runs_a_forward(example_checkpoint):
    llm = LLM(example_checkpoint, device="cpu", show_progress=False)
    assert llm.family.name == "parallel_block"
    out = llm.generate([1, 2, 3, 4], SamplingParams(max_tokens=5, temperature=0.0))[0]
    assert len(out.token_ids) == 5 and all(0 <= t < llm.vocab_size for t in out.token_ids)
    assert llm.score([1, 2, 3]).shape == (3, llm.vocab_size)


def test_a_family_that_does_not_shard_is_refused_on_a_rank_of_several(example_checkpoint):
    """A model whose family has not said it runs tensor-parallel (tensor_parallel_capable) is
    refused with a clear error on a rank of a group of several, before it could run half a model."""
    from metrale.backends.parallel import Shard, rank_context, run_ranks
    from metrale.errors import ConfigError

    def work(communicator):
        with rank_context(Shard(communicator.rank, 2), communicator):
            LLM(example_checkpoint, device="cpu", show_progress=False)

    with pytest.raises(ConfigError, match="does not run tensor-parallel yet"):
        run_ranks(2, work)
