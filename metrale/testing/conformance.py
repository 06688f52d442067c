"""The conformance suite every model family runs against itself.

Usage, in a plugin's test module::

    from metrale.testing import FamilyConformance

    class TestMyFamily(FamilyConformance):
        @pytest.fixture(scope="class")
        @classmethod
        def conformance_checkpoint(cls, tmp_path_factory):
            return build_my_checkpoint(tmp_path_factory.mktemp("ckpt"))

        def reference_logits(self, checkpoint, token_ids):
            return my_reference_forward(checkpoint, token_ids)   # [len, vocab] float

The suite loads the checkpoint on the CPU backend. ``prompt_lengths``, ``chunk_sizes`` and
``tolerance`` (max-abs error over logits, relative to the reference's max-abs logit) may be
overridden as class attributes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pytest

from metrale.sequence import PrefillSlice, SequenceState


def max_relative_error(actual: Any, expected: Any) -> float:
    """``max|actual - expected| / max|expected|`` (the parity measure of the test suite)."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if actual.shape != expected.shape:
        raise AssertionError(f"shape {actual.shape} differs from the reference's {expected.shape}")
    scale = max(float(np.abs(expected).max()), 1e-30)
    return float(np.abs(actual - expected).max()) / scale


def assert_close(actual: Any, expected: Any, tolerance: float, what: str) -> None:
    error = max_relative_error(actual, expected)
    worst = float(np.abs(np.asarray(actual, np.float64) - np.asarray(expected, np.float64)).max())
    assert error <= tolerance, f"{what}: relative error {error:.3g} > {tolerance:.3g} (max abs {worst:.3g})"


def check_tensor_parallel(checkpoint: Path, size: int, token_ids: Sequence[int], *, expert_parallel: bool = False,
                          tolerance: float = 1e-4, device: str = "cpu") -> float:
    """Score ``token_ids`` with the model at ``checkpoint`` whole, then as ``size`` ranks of a
    tensor-parallel group simulated in one process (each rank loads its shard on its own thread,
    :func:`metrale.backends.parallel.run_ranks`); raise AssertionError unless every rank's logits equal the
    whole model's within ``tolerance`` (:func:`max_relative_error`). Returns the largest error.
    ``device="cuda"`` runs the whole model and every rank on the GPU (the ranks' collectives
    through host copies, CUDA graphs off): the sharded GPU kernels checked on one device."""
    from metrale.backends.parallel import Shard, rank_context, run_ranks
    from metrale.entrypoints.llm import LLM

    def score() -> np.ndarray:
        options: dict[str, Any] = {"cuda_graphs": False} if device != "cpu" else {}
        with LLM(checkpoint, device=device, show_progress=False, **options) as llm:
            return np.asarray(llm.score(list(token_ids)))

    expected = score()

    def rank(communicator: Any) -> np.ndarray:
        with rank_context(Shard(communicator.rank, size, expert_parallel), communicator):
            return score()

    errors = [max_relative_error(got, expected) for got in run_ranks(size, rank)]
    worst = max(errors)
    if worst > tolerance:
        raise AssertionError(f"tensor_parallel_size={size}{' with expert parallelism' if expert_parallel else ''}: "
                             f"ranks' logits differ from the whole model's by {errors} (tolerance {tolerance})")
    return worst


def assert_varied_greedy(continuations: Sequence[Sequence[int]], vocab_size: int) -> None:
    """Fail when greedy continuations are degenerate -- one token repeated, or a handful for all
    prompts -- since checks that compare them then test little (the checkpoint's random weights
    need more noise, or a norm is an identity)."""
    tokens = [t for continuation in continuations for t in continuation]
    distinct = len(set(tokens))
    needed = min(len(tokens) // 4, vocab_size // 4, 8)
    assert distinct >= needed, (
        f"greedy output is degenerate: {distinct} distinct tokens in {len(tokens)} ({sorted(set(tokens))[:8]}); "
        "the checkpoint's weights leave too little for the greedy checks to compare"
    )


class KernelConformance:
    """Checks the kernels the installed plugins register (``metrale_register_ops``) against their
    ops' references: on the CPU, and each CUDA kernel on the GPU where one is usable, else under
    numba's CUDA simulator and compiled for compute capability 9.0 with NVVM
    (:mod:`metrale.testing.kernel_check`). :class:`FamilyConformance` includes these checks; a
    plugin that adds ops or kernels but no family subclasses this class alone.
    """

    #: Plugin CUDA kernels the checks without a GPU leave out, by kernel name, each with the
    #: reason (a CuPy ``RawKernel``, which numba's simulator cannot run); a GPU still checks them.
    unchecked_kernels: Mapping[str, str] = {}

    def _plugin_cuda_kernels(self) -> tuple[Any, list[str]]:
        """The installed plugins' registry and the names of their CUDA kernels the checks without
        a GPU run; fails on a name of :attr:`unchecked_kernels` that no plugin registers."""
        from metrale.model.plugin_manager import get_plugin_manager
        from metrale.ops import build_op_registry
        from metrale.ops.check import plugin_kernels

        registry = build_op_registry(get_plugin_manager())
        names = [kernel.name for kernel in plugin_kernels(registry, "cuda")]
        stale = sorted(set(self.unchecked_kernels) - set(names))
        assert not stale, (f"unchecked_kernels names {stale}, which no plugin registers as a CUDA kernel "
                           f"(plugin CUDA kernels: {names})")
        return registry, [name for name in names if name not in self.unchecked_kernels]

    def test_plugin_kernels_match_their_references(self) -> None:
        """Every kernel a plugin registers (``metrale_register_ops``) agrees with its op's
        reference on the op's examples and its own: on the CPU, and its CUDA kernels on the GPU
        where one is usable, else under numba's CUDA simulator
        (:mod:`metrale.testing.kernel_check`). A kernel that could not be checked at all fails
        too, named, unless :attr:`unchecked_kernels` leaves it out of the check without a GPU."""
        from metrale.backends.base import CpuBackend
        from metrale.backends.devices import cuda_unavailable_reason, get_backend
        from metrale.errors import KernelMismatchError
        from metrale.ops.check import assert_kernels_match
        from metrale.testing.kernel_check import run_check

        registry, simulated = self._plugin_cuda_kernels()
        assert_kernels_match(registry, CpuBackend())
        if cuda_unavailable_reason() is None:
            assert_kernels_match(registry, get_backend("cuda"))
        elif simulated:
            report = run_check("simulated", skip=tuple(self.unchecked_kernels), expect=simulated)
            if report.problems:
                raise KernelMismatchError(
                    "\n".join(report.problems) + "\n(without a GPU these kernels ran under numba's CUDA simulator; name a "
                    "kernel the simulator cannot run, with the reason, in the test class's unchecked_kernels)"
                )

    def test_plugin_cuda_kernels_compile(self) -> None:
        """Every numba kernel a plugin's CUDA kernels launch on their examples compiles for compute
        capability 9.0 with NVVM, without a GPU (:mod:`metrale.testing.kernel_check`); skipped,
        saying why, where NVVM is not installed."""
        from metrale.testing.kernel_check import run_check

        _, compiled = self._plugin_cuda_kernels()
        if not compiled:
            return
        report = run_check("compiled", skip=tuple(self.unchecked_kernels), expect=compiled)
        if report.unavailable is not None:
            pytest.skip(report.unavailable)
        assert not report.problems, "\n".join(report.problems)


class FamilyConformance(KernelConformance):
    """Checks a model family against the forward contract and a reference (and, through
    :class:`KernelConformance`, the plugins' kernels).

    Subclasses provide the fixture ``conformance_checkpoint`` (a checkpoint folder) and the
    method :meth:`reference_logits`.
    """

    prompt_lengths: Sequence[int] = (1, 7, 40)
    chunk_sizes: Sequence[int] = (1, 5, 16)
    tolerance: float = 1e-4
    #: Internal consistency (two paths of the same engine) is held to a tighter bound.
    self_tolerance: float = 1e-5
    seed: int = 1234
    #: Tensor-parallel sizes to check (ranks simulated on threads against the whole model,
    #: :func:`check_tensor_parallel`); empty for a family that does not run tensor-parallel
    #: (``FamilyModel.tensor_parallel_capable`` False).
    tensor_parallel_sizes: Sequence[int] = ()
    #: Whether the tensor-parallel check runs with expert parallelism too (MoE families).
    expert_parallel: bool = False

    # ------------------------------------------------------------------------ to provide

    def reference_logits(self, checkpoint: Path, token_ids: list[int]) -> np.ndarray:
        """Logits ``[len(token_ids), vocab]`` of an independent implementation."""
        raise NotImplementedError("a conformance test class must implement reference_logits()")

    # --------------------------------------------------------------------------- fixtures

    @pytest.fixture(scope="class")
    @classmethod
    def conformance_llm(cls, conformance_checkpoint: Path) -> Any:
        from metrale.entrypoints.llm import LLM

        return LLM(conformance_checkpoint, device="cpu", show_progress=False)

    def token_ids(self, llm: Any, length: int, salt: int = 0) -> list[int]:
        generator = np.random.default_rng([self.seed, length, salt])
        return generator.integers(0, llm.vocab_size, size=length).tolist()

    # ------------------------------------------------------------------------------ checks

    def test_cache_spec_is_valid(self, conformance_llm: Any) -> None:
        spec = conformance_llm.forward.cache_spec()
        spec.validate()
        assert spec.layers, "the cache spec lists no layer"

    def test_checkpoint_mapping_covers_every_tensor(self, conformance_checkpoint: Path) -> None:
        from metrale.backends.base import CpuBackend
        from metrale.config import EngineConfig
        from metrale.loading.checkpoint import Checkpoint
        from metrale.model.family import resolve_family
        from metrale.model.plugin_manager import get_plugin_manager

        manager = get_plugin_manager()
        checkpoint = Checkpoint(conformance_checkpoint)
        family = resolve_family(manager, checkpoint.config)
        model = manager.hook.metrale_load_model(
            family=family, checkpoint=checkpoint, backend=CpuBackend(), config=EngineConfig(device="cpu")
        )
        assert model is not None, f"no plugin loaded family {family.name!r}"
        assert checkpoint.unconsumed() == [], f"tensors the family never read: {checkpoint.unconsumed()}"

    def test_logits_match_reference(self, conformance_llm: Any, conformance_checkpoint: Path) -> None:
        for length in self.prompt_lengths:
            ids = self.token_ids(conformance_llm, length)
            expected = self.reference_logits(conformance_checkpoint, ids)
            assert_close(conformance_llm.score(ids), expected, self.tolerance, f"score() of {length} tokens")

    def test_prefill_then_decode_matches_score(self, conformance_llm: Any) -> None:
        llm = conformance_llm
        length = max(self.prompt_lengths)
        ids = self.token_ids(llm, length, salt=1)
        scored = llm.score(ids)
        prompt = max(1, length // 4)
        seq = SequenceState.from_prompt(ids[:prompt])
        try:
            rows = [llm.backend.to_numpy(llm.forward.prefill(ids[:prompt], seq))[0]]
            for token in ids[prompt:]:
                rows.append(llm.backend.to_numpy(llm.forward.decode(token, seq))[0])
        finally:
            llm.cache.release(seq)
        assert_close(np.stack(rows), scored[prompt - 1 :], self.self_tolerance, "prefill + decode vs score")

    def test_chunked_prefill_matches_whole_prefill(self, conformance_llm: Any) -> None:
        llm = conformance_llm
        if llm.forward.is_mla():
            pytest.skip("the contract prefills an MLA prompt as one chunk")
        for chunk in self.chunk_sizes:
            self._check_chunked_prefill(llm, chunk)

    def _check_chunked_prefill(self, llm: Any, chunk: int) -> None:
        ids = self.token_ids(llm, max(self.prompt_lengths), salt=2)
        whole_seq, chunk_seq = SequenceState.from_prompt(ids), SequenceState.from_prompt(ids)
        try:
            whole = llm.backend.to_numpy(llm.forward.prefill(ids, whole_seq))
            logits = None
            for start in range(0, len(ids), chunk):
                length = min(chunk, len(ids) - start)
                last = start + length == len(ids)
                logits = llm.forward.prefill_chunk(ids, chunk_seq, start, length, last)
                assert (logits is None) != last, "prefill_chunk must return logits on the last chunk only"
                if not last:
                    llm.forward.normalize_ssm_states(chunk_seq)
            assert_close(llm.backend.to_numpy(logits), whole, self.self_tolerance, f"chunks of {chunk}")
            # Both caches must continue identically.
            token = int(np.argmax(whole[0]))
            after_whole = llm.backend.to_numpy(llm.forward.decode(token, whole_seq))
            after_chunks = llm.backend.to_numpy(llm.forward.decode(token, chunk_seq))
            assert_close(after_chunks, after_whole, self.self_tolerance, f"decode after chunks of {chunk}")
        finally:
            llm.cache.release(whole_seq)
            llm.cache.release(chunk_seq)

    def test_batched_steps_match_single_steps(self, conformance_llm: Any) -> None:
        llm = conformance_llm
        prompts = [self.token_ids(llm, n, salt=3) for n in (3, 17, 9)]
        singles, batched = [], []
        seqs = [SequenceState.from_prompt(p) for p in prompts]
        alone = [SequenceState.from_prompt(p) for p in prompts]
        try:
            for prompt, seq in zip(prompts, alone):
                singles.append(llm.backend.to_numpy(llm.forward.prefill(prompt, seq))[0])
            slices = [PrefillSlice(p, s, 0, len(p), True) for p, s in zip(prompts, seqs)]
            for logits in llm.forward.prefill_batch_chunk(slices):
                batched.append(llm.backend.to_numpy(logits)[0])
            assert_close(np.stack(batched), np.stack(singles), self.self_tolerance, "prefill_batch_chunk")
            tokens = [int(np.argmax(row)) for row in singles]
            one_by_one = np.stack([llm.backend.to_numpy(llm.forward.decode(t, s))[0] for t, s in zip(tokens, alone)])
            together = llm.backend.to_numpy(llm.forward.decode_batch(tokens, seqs))
            assert_close(together, one_by_one, self.self_tolerance, "decode_batch vs decode")
        finally:
            for seq in seqs + alone:
                llm.cache.release(seq)

    def test_mixed_forward_matches_separate_steps(self, conformance_llm: Any) -> None:
        llm = conformance_llm
        if llm.forward.is_mla():
            pytest.skip("MLA families prefill as one chunk")
        decode_prompt = self.token_ids(llm, 6, salt=4)
        prefill_prompt = self.token_ids(llm, 11, salt=5)
        mixed_decode, solo_decode = SequenceState.from_prompt(decode_prompt), SequenceState.from_prompt(decode_prompt)
        mixed_prefill, solo_prefill = SequenceState.from_prompt(prefill_prompt), SequenceState.from_prompt(prefill_prompt)
        try:
            token = int(np.argmax(llm.backend.to_numpy(llm.forward.prefill(decode_prompt, mixed_decode))[0]))
            llm.forward.prefill(decode_prompt, solo_decode)
            result = llm.forward.mixed_forward([token], [mixed_decode], prefill_prompt, mixed_prefill, 0, 11, True)
            expected_decode = llm.backend.to_numpy(llm.forward.decode(token, solo_decode))
            expected_prefill = llm.backend.to_numpy(llm.forward.prefill(prefill_prompt, solo_prefill))
            assert_close(llm.backend.to_numpy(result.decode_logits), expected_decode, self.self_tolerance, "mixed decode rows")
            assert_close(llm.backend.to_numpy(result.prefill_logits), expected_prefill, self.self_tolerance, "mixed prefill row")
        finally:
            for seq in (mixed_decode, solo_decode, mixed_prefill, solo_prefill):
                llm.cache.release(seq)

    def test_batched_prefill_rows_and_ineligible_batches(self, conformance_llm: Any) -> None:
        """``prefill_batch_chunk_rows`` returns each finishing slice's logits (None for the
        others), equal to its own prefill; a batch that is not admissible (two chunks of one
        sequence) runs slice by slice and still gives the whole prompt's logits."""
        llm = conformance_llm
        if llm.forward.is_mla():
            pytest.skip("MLA families prefill as one chunk")
        prompts = [self.token_ids(llm, n, salt=30 + n) for n in (4, 9, 6)]
        alone = [SequenceState.from_prompt(p) for p in prompts]
        seqs = [SequenceState.from_prompt(p) for p in prompts]
        whole, split = SequenceState.from_prompt(prompts[1]), SequenceState.from_prompt(prompts[1])
        try:
            expected = [llm.backend.to_numpy(llm.forward.prefill(p, s)) for p, s in zip(prompts, alone)]
            slices = [PrefillSlice(prompts[0], seqs[0], 0, 4, True), PrefillSlice(prompts[1], seqs[1], 0, 8, False),
                      PrefillSlice(prompts[2], seqs[2], 0, 6, True)]
            results = llm.forward.prefill_batch_chunk_rows(slices, None, 2)
            assert results[1] is None, "a slice that does not finish its prompt returned logits"
            assert_close(llm.backend.to_numpy(results[0]), expected[0], self.self_tolerance, "rows: slice 0")
            assert_close(llm.backend.to_numpy(results[2]), expected[2], self.self_tolerance, "rows: slice 2")
            reference = llm.backend.to_numpy(llm.forward.prefill(prompts[1], whole))
            twice = [PrefillSlice(prompts[1], split, 0, 5, False), PrefillSlice(prompts[1], split, 5, 4, True)]
            outcome = llm.forward.prefill_batch_chunk(twice)
            assert outcome[0] is None and split.num_cached == len(prompts[1])
            assert_close(llm.backend.to_numpy(outcome[1]), reference, self.self_tolerance, "ineligible batch")
        finally:
            for seq in alone + seqs + [whole, split]:
                llm.cache.release(seq)

    def test_tensor_parallel_ranks_match_the_whole_model(self, conformance_checkpoint: Path) -> None:
        """Each rank of a simulated tensor-parallel group gives the whole model's logits (for each
        of ``tensor_parallel_sizes``, with expert parallelism too when ``expert_parallel``)."""
        if not self.tensor_parallel_sizes:
            pytest.skip("the family does not run tensor-parallel (tensor_parallel_sizes is empty)")
        generator = np.random.default_rng([self.seed, 99])
        from metrale.entrypoints.llm import LLM

        with LLM(conformance_checkpoint, device="cpu", show_progress=False) as llm:
            vocab = llm.vocab_size
        tokens = generator.integers(0, vocab, size=max(self.prompt_lengths)).tolist()
        for size in self.tensor_parallel_sizes:
            for expert_parallel in (False, True) if self.expert_parallel else (False,):
                check_tensor_parallel(conformance_checkpoint, size, tokens, expert_parallel=expert_parallel,
                                      tolerance=self.tolerance)

    def test_engine_matches_solo_runs(self, conformance_checkpoint: Path) -> None:
        """The engine -- continuous batching with chunked, batched and mixed prefill, prefix-cache
        hits and preemption in a small cache -- gives every request the greedy tokens it gets
        when it runs alone, and frees every block afterwards."""
        from metrale.entrypoints.llm import LLM
        from metrale.params import SamplingParams

        solo = LLM(conformance_checkpoint, device="cpu", show_progress=False, max_num_seqs=1,
                   enable_prefix_caching=False)
        shared = self.token_ids(solo, 9, salt=6)
        prompts = [self.token_ids(solo, n, salt=7 + i) for i, n in enumerate((5, 23, 2, 14))]
        prompts += [shared + self.token_ids(solo, n, salt=20 + n) for n in (3, 8)]
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        expected = [solo.generate([p], params)[0].token_ids for p in prompts]
        assert_varied_greedy(expected, solo.vocab_size)
        block_size = solo.forward.kv_block_size() or 4
        longest = -(-(max(len(p) for p in prompts) + params.max_tokens) // block_size)
        llm = LLM(conformance_checkpoint, device="cpu", show_progress=False, max_num_seqs=3, block_size=block_size,
                  num_blocks=longest + 3, max_num_batched_tokens=max(block_size, 8))
        outputs = llm.generate(prompts, params)
        assert [o.token_ids for o in outputs] == expected, "engine steps changed a request's greedy tokens"
        again = llm.generate(prompts[-1:], params)[0]
        assert again.token_ids == expected[-1], "a prefix-cache hit changed the greedy tokens"
        allocator = llm.cache.allocator
        assert allocator.num_free == allocator.num_blocks, "blocks leaked"
        assert all(allocator.ref_count(b) == 0 for b in range(1, allocator.num_blocks + 1)), "blocks still referenced"
