"""Tensor parallelism with real worker ranks (metrale.backends.executor): an LLM with
tensor_parallel_size=2 starts a worker process (or a Ray actor) for rank 1, sends it each step's
metadata, and generates what one rank generates; a lost worker fails the step with RankError
instead of hanging; what TP does not serve yet is refused before anything starts."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from multiprocessing import Pipe

import numpy as np
import pytest

from metrale import LLM, SamplingParams
from metrale.backends.parallel import HubCommunicator, RankLostError
from metrale.errors import ConfigError, RankError
from metrale.testing.conformance import max_relative_error

PROMPT = [5, 17, 99, 3, 42, 8, 61, 23, 77, 14, 2, 90]
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2)


def results(checkpoint, prompts, **options):
    with LLM(str(checkpoint), device="cpu", show_progress=False, **options) as llm:
        return llm.score(PROMPT), [o.outputs[0] for o in llm.generate(prompts, PARAMS)]


def assert_same(got, expected):
    (scores, outputs), (expected_scores, expected_outputs) = got, expected
    assert max_relative_error(scores, expected_scores) <= 1e-4
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected_outputs]
    for output, want in zip(outputs, expected_outputs):
        for a, b in zip(output.logprobs, want.logprobs):
            assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) <= 1e-4 for t in a)


def test_a_dense_model_over_two_worker_ranks_equals_one_rank(dense_checkpoints):
    prompts = [PROMPT, PROMPT[3:], PROMPT[:5]]
    checkpoint = dense_checkpoints["llama"]
    assert_same(results(checkpoint, prompts, tensor_parallel_size=2), results(checkpoint, prompts))


def test_an_mla_model_with_expert_parallelism_over_two_worker_ranks(mla_checkpoints):
    prompts = [PROMPT, PROMPT[3:]]
    checkpoint = mla_checkpoints["deepseek_v3"]
    assert_same(results(checkpoint, prompts, tensor_parallel_size=2, expert_parallel=True),
                results(checkpoint, prompts))


def test_a_gdn_model_s_state_writes_reach_the_worker(gdn_checkpoint):
    """Prompts sharing a long prefix, one after another: the second starts from a state snapshot
    the driver's cache took and restored (slots zeroed, rows copied); the worker's cache makes the
    same writes, so its value heads' states match."""
    prefix = [int(t) for t in np.random.default_rng(4).integers(1, 120, 40)]
    options = dict(enable_prefix_caching=True, block_size=8, num_state_snapshots=8, max_num_batched_tokens=8)

    def run(**extra):
        with LLM(str(gdn_checkpoint), device="cpu", show_progress=False, **options, **extra) as llm:
            first = llm.generate([prefix + [7, 9]], PARAMS)[0].outputs[0]
            second = llm.generate([prefix + [11, 3, 5]], PARAMS)[0].outputs[0]
            return (llm.score(PROMPT), [first, second]), llm.engine.prefix_cache.hit_blocks

    got, hits = run(tensor_parallel_size=2)
    expected, _ = run()
    assert hits >= 4  # the second prompt started from a restored snapshot
    assert_same(got, expected)


SPECULATIVE_CASES = [("tiny-dense", "ngram"), ("tiny-mla", "ngram"), ("tiny-mla", "mtp"), ("tiny-gdn", "ngram"),
                     ("tiny-gdn", "mtp")]


@pytest.mark.parametrize("model, method", SPECULATIVE_CASES)
def test_speculation_over_two_worker_ranks_keeps_the_greedy_tokens(model, method):
    """Speculative decoding with tensor_parallel_size=2: the verify runs on both ranks (a
    verify's per-row recurrent states too), the verdict reaches the worker, the MTP module runs on
    both; the greedy tokens are those of one rank without speculation, and drafts were kept."""
    prompt = [int(t) for t in np.random.default_rng(3).integers(5, 200, 8)] * 3
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with LLM(model, device="cpu", show_progress=False) as plain:
        expected = plain.generate(prompt, params)[0].token_ids
    speculative = {"method": method, "num_speculative_tokens": 2}
    with LLM(model, device="cpu", show_progress=False, tensor_parallel_size=2, speculative_config=speculative) as llm:
        assert llm.generate(prompt, params)[0].token_ids == expected
        accepted = llm.engine.accepted_tokens
    assert accepted > 0


LORA_TARGETS = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "qwen3_moe": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "deepseek_v2": ["q_proj", "kv_a_proj_with_mqa", "o_proj"],
    "deepseek_v3": ["q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "o_proj"],
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    "gdn": ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkvz", "in_proj_ba", "out_proj"],
}


def phi3_checkpoint(folder):
    """A tiny Phi-3 with fused q/k/v and gate/up matrices (two KV heads, so each rank holds one)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    from metrale.testing.hf import build_hf_checkpoint

    config = Phi3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return build_hf_checkpoint(Phi3ForCausalLM, config, folder, seed=9)


@pytest.mark.parametrize("family, options", [("llama", {}), ("qwen3_moe", {"expert_parallel": True}),
                                             ("deepseek_v2", {}), ("deepseek_v3", {"expert_parallel": True}),
                                             ("phi3", {}), ("gdn", {})])
def test_lora_over_two_worker_ranks_equals_one_rank(dense_checkpoints, moe_checkpoints, mla_checkpoints, gdn_checkpoint,
                                                    tmp_path, family, options):
    """Adapters on the attention and MLP projections (and one replacing embedding rows), two at
    once in a batch with the base model: each rank writes its part of each adapter, and the
    logits and greedy tokens are one rank's."""
    from metrale import LoRARequest
    from metrale.testing.hf import build_peft_adapter

    models = {**dense_checkpoints, **moe_checkpoints, **mla_checkpoints, "gdn": gdn_checkpoint}
    checkpoint = phi3_checkpoint(tmp_path / "phi3") if family == "phi3" else models[family]
    build_peft_adapter(checkpoint, tmp_path / "a", seed=1, r=8, lora_alpha=16, target_modules=LORA_TARGETS[family])
    build_peft_adapter(checkpoint, tmp_path / "b", seed=2, r=4, lora_alpha=8, target_modules=LORA_TARGETS[family][:2],
                       trainable_token_indices={"embed_tokens": [3, 5]})
    requests = [LoRARequest("a", 1, tmp_path / "a"), LoRARequest("b", 2, tmp_path / "b"), None]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def run(**extra):
        with LLM(str(checkpoint), device="cpu", show_progress=False, enable_lora=True, max_loras=2, max_lora_rank=8,
                 **extra) as llm:
            scores = [llm.score(PROMPT, lora_request=request) for request in requests]
            outputs = llm.generate([PROMPT, PROMPT[2:], PROMPT[:7]], params, lora_request=requests)
            return scores, [o.outputs[0].token_ids for o in outputs]

    (scores, tokens), (expected_scores, expected_tokens) = run(tensor_parallel_size=2, **options), run()
    assert all(max_relative_error(got, want) <= 1e-4 for got, want in zip(scores, expected_scores))
    assert tokens == expected_tokens
    assert max_relative_error(expected_scores[0], expected_scores[2]) > 1e-2  # the adapter changes the logits


def test_a_stack_that_does_not_say_its_part_is_refused_on_a_rank():
    """A family's adapter stack built on a rank of a group without saying which part of the
    projection the rank holds is refused, never built over the whole adapter."""
    from types import SimpleNamespace

    from metrale.backends.base import CpuBackend
    from metrale.backends.parallel import Shard
    from metrale.layers.lora import new_stack

    backend = CpuBackend()
    backend.shard = Shard(0, 2)
    owner = SimpleNamespace(weight=np.zeros((4, 8), np.float32))
    with pytest.raises(ConfigError, match="not served with tensor parallelism"):
        new_stack(backend, owner, "weight", ("mlp.w",), (4,), {"max_loras": 1, "max_lora_rank": 2})


def test_a_lost_worker_fails_the_step_with_a_rank_error(dense_checkpoints):
    """Four ranks, rank 2's process killed: the next step raises RankError naming it (rank 0
    releases ranks 1 and 3 from the collective they wait in), later steps refuse, and close()
    stops the survivors at once."""
    llm = LLM(str(dense_checkpoints["llama"]), device="cpu", show_progress=False, tensor_parallel_size=4)
    try:
        assert llm.generate([PROMPT], PARAMS)[0].outputs[0].token_ids
        workers = llm.ranks._workers
        workers[1].kill()
        workers[1].wait(10)
        started = time.monotonic()
        with pytest.raises(RankError, match="rank 2"):
            llm.generate([PROMPT], PARAMS)
        with pytest.raises(RankError, match="build it again"):
            llm.generate([PROMPT[:4]], PARAMS)
        assert time.monotonic() - started < 60
    finally:
        started = time.monotonic()
        llm.close()
    assert llm.closed and time.monotonic() - started < 10
    assert all(worker.poll() is not None for worker in workers)


def test_a_worker_that_fails_a_step_fails_it_on_rank_0(dense_checkpoints):
    """A write the worker's cache refuses (slipped into the step's state writes): the worker
    reports its CacheError, rank 0's step raises RankError with it, and the group refuses
    further steps."""
    llm = LLM(str(dense_checkpoints["llama"]), device="cpu", show_progress=False, tensor_parallel_size=2)
    try:
        llm.ranks._state_writes.append(("grow", 1))
        with pytest.raises(RankError, match="rank 1 failed: CacheError.*unknown state-row write"):
            llm.score(PROMPT)
        with pytest.raises(RankError, match="build it again"):
            llm.score(PROMPT)
    finally:
        llm.close()


def children_of(pid):
    """The processes whose parent is ``pid`` (Linux's /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    fields = handle.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


async def last_output(engine, prompt):
    output = None
    async for output in engine.generate(prompt, PARAMS):
        pass
    return output


@pytest.mark.parametrize("engine_kind", ["thread", "process"])
def test_a_broken_group_stops_the_engine_so_it_reports_itself_down(engine_kind):
    """Served engines (AsyncLLM's thread, EngineProcess): after a worker is lost, the request in
    flight fails with the rank's error and the engine no longer reports itself running (the
    server's /health then answers 503)."""
    from metrale.entrypoints.async_llm import AsyncLLM
    from metrale.entrypoints.engine_process import EngineProcess

    options = dict(device="cpu", show_progress=False, tensor_parallel_size=2)
    engine = (AsyncLLM if engine_kind == "thread" else EngineProcess)("tiny-dense", **options)
    try:
        assert asyncio.run(last_output(engine, PROMPT)).outputs[0].token_ids
        if engine_kind == "thread":
            engine.llm.ranks._workers[0].kill()
        else:
            (worker,) = children_of(engine._process.pid)
            os.kill(worker, signal.SIGKILL)
        output = asyncio.run(last_output(engine, PROMPT))
        assert output.finish_reason == "error" and "rank 1" in output.error
        deadline = time.monotonic() + 30
        while engine.is_running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine.is_running
    finally:
        engine.shutdown()


@pytest.mark.parametrize("options, match", [
    (dict(distributed_executor_backend="mpi"), "distributed_executor_backend"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size"),
    (dict(expert_parallel=1), "expert_parallel"),
])
def test_what_tensor_parallelism_does_not_serve_is_refused(dense_checkpoints, options, match):
    options = {"device": "cpu", "tensor_parallel_size": 2, **options}
    with pytest.raises(ConfigError, match=match):
        LLM(str(dense_checkpoints["llama"]), show_progress=False, **options)


def test_cuda_ranks_without_a_gpu_are_refused_before_any_worker_starts(dense_checkpoints, monkeypatch):
    from metrale.backends import executor
    from metrale.errors import BackendUnavailableError

    monkeypatch.setattr(executor.RankExecutor, "start", lambda self: pytest.fail("a worker was started"))
    with pytest.raises(BackendUnavailableError, match="device='cuda' cannot be used"):
        LLM(str(dense_checkpoints["llama"]), device="cuda", show_progress=False, tensor_parallel_size=2)


def test_gpu_ranks_take_one_visible_device_each(monkeypatch, tmp_path):
    from metrale.backends import executor

    monkeypatch.setattr(executor, "new_nccl_id", lambda: ("id",))
    monkeypatch.setattr(executor, "visible_cuda_devices", lambda: ["7"])
    with pytest.raises(ConfigError, match="takes 2 GPUs, one a rank; this process sees 1 \\(7\\)"):
        executor.RankExecutor(tmp_path, {}, 2, gpu=True)
    monkeypatch.setattr(executor, "visible_cuda_devices", lambda: ["7", "5", "2"])
    with pytest.raises(ConfigError, match="Ray executor runs CPU ranks only"):
        executor.RankExecutor(tmp_path, {}, 2, backend="ray", gpu=True)

    started = []

    class Recorder:
        def __init__(self, command, stdin, env):
            self.stdin, self.env = open(os.devnull, "wb"), env
            started.append(self)

    monkeypatch.setattr(executor.subprocess, "Popen", Recorder)
    ranks = executor.RankExecutor(tmp_path, {}, 3, gpu=True)
    assert ranks.spec.nccl_id == ("id",) and ranks.spec.devices == ("7", "5", "2")
    ranks._start_processes()
    ranks._listener.close()
    assert [worker.env["CUDA_VISIBLE_DEVICES"] for worker in started] == ["5", "2"]


def test_a_gpu_worker_that_cannot_join_nccl_fails_the_start_with_its_error(dense_checkpoints, monkeypatch):
    """The GPU start-up path on a machine without one: the worker gets its device and the NCCL
    id, fails to join (no CUDA here), says why and exits; rank 0, waiting in the NCCL
    initialisation for it, stops waiting and raises RankError with the worker's error."""
    from metrale.backends import executor

    monkeypatch.setattr(executor, "visible_cuda_devices", lambda: ["0", "1"])
    monkeypatch.setattr(executor, "new_nccl_id", lambda: (b"\0" * 128,))
    monkeypatch.setattr(executor, "new_nccl_communicator", lambda *args: threading.Event().wait())
    ranks = executor.RankExecutor(dense_checkpoints["llama"], {"device": "cpu"}, 2, gpu=True)
    started = time.monotonic()
    with pytest.raises(RankError, match="did not start: rank 1 failed in step 0: .*(cupy|CUDA)"):
        ranks.start()
    assert time.monotonic() - started < 60
    ranks.close()
    assert ranks._workers[0].poll() is not None


@pytest.mark.parametrize("listed, expected", [
    ("1,3", ["1", "3"]), (" 0 , GPU-5a1e ", ["0", "GPU-5a1e"]), ("0,-1,2", ["0"]), ("", []), (None, ["0", "1"]),
])
def test_visible_cuda_devices_follow_cuda_visible_devices(monkeypatch, listed, expected):
    from metrale.backends.parallel import visible_cuda_devices

    if listed is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", listed)
    assert visible_cuda_devices(count=2) == expected


class FakeCollectives:
    def __init__(self):
        self.aborted = threading.Event()

    def abort(self):
        self.aborted.set()

    def close(self):
        pass


class FakeWorker:
    returncode = None

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        return self.returncode

    def kill(self):
        pass


def test_the_gpu_watchdog_aborts_nccl_when_a_worker_is_lost(tmp_path, monkeypatch):
    """A lost worker leaves rank 0 waiting on the device: the watchdog breaks the group and aborts
    the NCCL group (which ends that wait); the step then fails with RankError, not with the
    broken step's output."""
    from metrale.backends import executor

    monkeypatch.setattr(executor, "WATCH_INTERVAL", 0.02)
    ranks = executor.RankExecutor(tmp_path, {}, 2)
    worker, collectives = FakeWorker(), FakeCollectives()
    ranks._workers, ranks.collectives = [worker], collectives
    watchdog = threading.Thread(target=ranks._watch)
    watchdog.start()
    time.sleep(0.1)
    assert not collectives.aborted.is_set() and ranks.broken is None

    class Backend:
        def synchronize(self):
            collectives.aborted.wait(5)  # (the device's wait, which only the abort ends)
            raise RuntimeError("the aborted collective's stream error")

    worker.returncode = -9
    with pytest.raises(RankError, match="rank 1's process exited with code -9"):
        ranks.finish(Backend())
    assert collectives.aborted.is_set(), "the watchdog did not abort the group"
    watchdog.join(5)
    assert not watchdog.is_alive()
    ranks.close()


def test_a_failed_rank_0_step_breaks_a_gpu_group(tmp_path):
    """On GPUs the workers' collectives of a step rank 0 gave up are queued on their devices and
    would pair with the next step's: any failure breaks the group and aborts NCCL."""
    from metrale.backends import executor

    ranks = executor.RankExecutor(tmp_path, {}, 2)
    ranks.collectives = FakeCollectives()
    ranks.abandon(KeyboardInterrupt())
    assert ranks.collectives.aborted.is_set()
    with pytest.raises(RankError, match="rank 0's step failed \\(KeyboardInterrupt"):
        ranks.finish(None)
    ranks.close()


def test_recorded_graphs_keep_the_ranks_in_step(dense_checkpoints):
    """capture_graphs() sends the workers the same capture (a no-op on the CPU): the steps after
    it still meet."""
    checkpoint = dense_checkpoints["llama"]
    with LLM(str(checkpoint), device="cpu", show_progress=False, tensor_parallel_size=2) as llm:
        llm.ranks.capture_graphs((1, 2), (1, 16))
        llm.capture_graphs([1])
        got = llm.score(PROMPT)
    assert max_relative_error(got, results(checkpoint, [PROMPT])[0]) <= 1e-4


def test_a_worker_process_exits_when_its_driver_is_gone(tmp_path):
    """A GPU worker whose driver died could be waiting on the device for ever: it watches its
    parent and exits."""
    import subprocess
    import sys

    child = ("import sys, time; from metrale.backends.executor import exit_with_parent; "
             "exit_with_parent(int(sys.argv[1]), 0.05); time.sleep(60)")
    parent = ("import os, subprocess, sys; child = subprocess.Popen([sys.executable, '-c', sys.argv[1], "
              "str(os.getpid())], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); print(child.pid, flush=True)")
    pid = int(subprocess.run([sys.executable, "-c", parent, child], capture_output=True, text=True,
                             check=True).stdout)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return  # exited, not yet reaped by its new parent
        except FileNotFoundError:
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    pytest.fail("the orphaned worker kept running")


def test_a_prepared_plugin_manager_is_refused(dense_checkpoints):
    from metrale.model.plugin_manager import get_plugin_manager

    with pytest.raises(ConfigError, match="plugin_manager"):
        LLM(str(dense_checkpoints["llama"]), device="cpu", show_progress=False, tensor_parallel_size=2,
            plugin_manager=get_plugin_manager())


def test_the_ray_executor_on_a_local_cluster(dense_checkpoints):
    ray = pytest.importorskip("ray")
    prompts = [PROMPT, PROMPT[:5]]
    checkpoint = dense_checkpoints["qwen2"]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=100 * 2**20)
    try:
        got = results(checkpoint, prompts, tensor_parallel_size=2, distributed_executor_backend="ray")
    finally:
        ray.shutdown()
    assert_same(got, results(checkpoint, prompts))


# ----------------------------------------------------------------------------- the hub's messages


def hub_pair(timeout=5.0):
    driver_end, worker_end = Pipe()
    return HubCommunicator(0, 2, [driver_end], timeout), HubCommunicator(1, 2, [worker_end], timeout)


def test_collectives_through_the_hub_give_every_rank_the_same_bits():
    zero, one = hub_pair()
    got = {}

    def worker():
        got["reduce"] = one.all_reduce(np.full(3, 2.0, np.float32))
        got["gather"] = one.all_gather(np.ones((1, 2), np.float32), axis=0)

    thread = threading.Thread(target=worker)
    thread.start()
    reduced = zero.all_reduce(np.arange(3, dtype=np.float32))
    gathered = zero.all_gather(np.zeros((1, 2), np.float32), axis=0)
    thread.join(10)
    np.testing.assert_array_equal(reduced, [2, 3, 4])
    np.testing.assert_array_equal(got["reduce"], reduced)
    np.testing.assert_array_equal(gathered, [[0, 0], [1, 1]])
    np.testing.assert_array_equal(got["gather"], gathered)


def test_a_failed_step_s_leftovers_are_dropped():
    """Rank 1 sent a part in step 1, which rank 0 abandoned; in step 2 rank 0 takes step 2's."""
    zero, one = hub_pair()
    one.step = 1
    one.send(0, "part", np.full(2, 100.0))
    zero.step = one.step = 2
    one.send(0, "part", np.full(2, 1.0))
    np.testing.assert_array_equal(zero.receive(1, "part"), [1, 1])


def test_a_rank_s_error_and_silence_raise_rank_lost():
    zero, one = hub_pair(timeout=0.2)
    one.send(0, "error", "out of memory")
    with pytest.raises(RankLostError, match="rank 1 failed: out of memory"):
        zero.all_reduce(np.zeros(2))
    with pytest.raises(RankLostError, match="sent nothing"):
        zero.all_reduce(np.zeros(2))
    one.connections[0].close()
    with pytest.raises(RankLostError, match="went away"):
        zero.all_reduce(np.zeros(2))
