"""Where a decode step's time goes: host overhead, graph replay, the gaps between replays, and each
op's GPU time.

    python tools/profiling/profile_decode.py [--shape llama-1b] [--batch 1] [--context 512] [--lora-adapters 0] [--lora-rank 16]
        [--quantization FORMAT]

Needs a CUDA device (and what ``metrale bench`` needs). Prints the whole step through
``ModelForward.decode_batch`` (host clock, synchronised), the same followed by the device sampler
and its tokens read back (greedy, as ``metrale bench`` times it; top-p; top-k with top-p), the
bare graph replay (CUDA events), the gaps between consecutive replays while ``LLM.generate``
decodes 64 tokens per sequence (CUDA events around every replay; a gap holds the sampler, the
copies, and the GPU's wait for the host), the same gaps taken apart in a second ``generate()``
with events around each piece of work outside the graph (the metadata upload, the pending
tokens' feed, the sampler),
and a table of every op of one decode forward: each call is recorded into its own CUDA graph
``REPEATS`` times and replayed, so the figure is the op's GPU time without launch overhead.
Ops are grouped by name and argument shapes (an op served by other ops, such as ``rmsnorm_mlp``
by the norm and the two products, is timed as one); products also show the GB/s of their weight
reads. ``--quantization`` loads the shape in a format of ``metrale bench --quantization`` (online,
or its checkpoint written from the bf16 one).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/timing.py is shared by the profiling tools and the sweeps

from timing import Timing, cuda_event_time, graph_time, host_time  # noqa: E402

REPEATS = 20
OPS = ("embedding", "rmsnorm_residual", "rmsnorm", "rmsnorm_linear", "rmsnorm_mlp", "linear", "linear_silu",
       "qkv_rope_cache", "paged_attention", "silu_and_mul", "latent_attention", "latent_cache_write", "head_linear",
       "moe_route", "moe_experts", "gdn_decode", "gdn_ungroup", "gdn_gates", "gdn_split_heads", "gdn_conv_update",
       "gdn_recurrent_step", "gdn_prompt_rule", "gated_rmsnorm", "sigmoid_gate", "lora_expand", "lora_linear")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-1b", help="a bench shape, or qwen3-0.6b (the throughput run's)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--workdir", default="/tmp/metrale-bench")
    parser.add_argument("--lora-adapters", type=int, default=0,
                        help="random rank --lora-rank LoRA adapters on every projection, the rows spread over them")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--quantization", default=None, metavar="FORMAT",
                        help="load the shape in this format of metrale bench --quantization (fp8, w4a16, ...)")
    args = parser.parse_args()

    from metrale.benchmarks.latency import build_checkpoint
    from metrale.benchmarks.throughput import build_qwen3_checkpoint
    from metrale.entrypoints.llm import LLM
    from metrale.params import SamplingParams
    from metrale.sequence import SequenceState

    # qwen3-0.6b is the shape of ``metrale bench --throughput``; the others are bench's shapes.
    build = build_qwen3_checkpoint if args.shape == "qwen3-0.6b" else lambda folder: build_checkpoint(args.shape, folder)
    folder, online = build(Path(args.workdir) / args.shape), None
    if args.quantization:
        from metrale.benchmarks.quantized import checkpoint_in_format

        folder, online = checkpoint_in_format(folder, Path(args.workdir), args.quantization)
    lora = {"enable_lora": True, "max_loras": args.lora_adapters, "max_lora_rank": args.lora_rank} if args.lora_adapters else {}
    llm = LLM(folder, device="cuda", max_model_len=args.context + 256, max_num_seqs=args.batch + 1, show_progress=False,
              quantization=online, **lora)
    backend = llm.backend
    stream = backend.stream
    rng = np.random.default_rng(0)
    seqs = [SequenceState.from_prompt(rng.integers(0, llm.vocab_size, args.context).tolist()) for _ in range(args.batch)]
    if args.lora_adapters:
        import json

        from metrale.loading.lora import LoRARequest

        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sweeps"))  # tools/sweeps/lora_bench.py writes the adapters
        from lora_bench import write_adapter

        config = json.loads((Path(folder) / "config.json").read_text())
        requests = [LoRARequest(f"adapter-{i}", i + 1, write_adapter(Path(args.workdir) / f"lora-{args.shape}-{i}",
                                                                        config, args.lora_rank, i))
                    for i in range(args.lora_adapters)]
        for index, seq in enumerate(seqs):
            seq.adapter_slot = llm.lora.acquire(requests[index % len(requests)])
    for seq in seqs:
        llm.forward.prefill(seq.tokens, seq)
    tokens = [1] * args.batch

    def step() -> None:
        llm.forward.decode_batch(tokens, seqs)
        backend.synchronize()

    step_time = host_time(step, warmup=3, repeats=30)
    # The step as the generation loop runs it: the forward, then the device sampler and the
    # tokens read back (what ``metrale bench`` times).
    seeds = list(range(args.batch))
    sampled_steps: dict[str, Timing] = {}
    for label, params in (
        ("greedy", SamplingParams(temperature=0.0)),
        ("top-p", SamplingParams(temperature=0.7, top_p=0.95)),  # the generate command's defaults
        ("top-k + top-p", SamplingParams(temperature=0.7, top_k=50, top_p=0.95)),
    ):

        def sampled_step() -> None:
            llm.engine.sampler.sample(llm.forward.decode_batch(tokens, seqs), [params] * args.batch, seeds,
                                      [0] * args.batch)

        sampled_steps[label] = host_time(sampled_step, warmup=0, repeats=20)
    runner = llm.model.runner.graphs
    replay = None  # (models not captured into graphs: none)
    if runner is not None:
        rung = runner.rungs[runner.rung_size(args.batch)]
        graph = rung.graphs[(runner.context_bucket(args.context + 1), bool(args.lora_adapters))]
        replay = cuda_event_time(lambda: graph.launch(stream=stream), stream, warmup=0, repeats=30)

    # The host gap between consecutive replays while the engine generates (overlap scheduling
    # as configured): CUDA events around every replay of a generate() call.
    gaps = replays = None
    if runner is not None:
        import cupy

        prompts = [rng.integers(0, llm.vocab_size, 64).tolist() for _ in range(args.batch)]
        generation = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        # The gaps as the engine leaves them (events around the replays only), then a second
        # generate() with events around each piece of work between replays, which adds their own
        # records to the gaps, for the breakdown.
        runner.replay_events = []
        llm.generate(prompts, generation, use_tqdm=False)
        events = runner.replay_events
        events[-1][1].synchronize()
        replays = [cupy.cuda.get_elapsed_time(start, end) for start, end, _ in events]
        gaps = [cupy.cuda.get_elapsed_time(end, following[0]) for (_, end, _), following in zip(events, events[1:])]
        runner.replay_events = []
        with marking_between_replays(llm, runner) as markers:
            llm.generate(prompts, generation, use_tqdm=False)
        marked = runner.replay_events
        runner.replay_events = None
        marked[-1][1].synchronize()
        gap_parts = split_gaps(marked, markers)

    # Record every op call of one eager decode forward, then time each in its own graph.
    ops = backend.ops
    originals = {name: getattr(ops, name, None) for name in OPS}
    calls = []
    depth = [0]

    def recording(name, function):
        # Only the calls the model makes: an op that runs others (a fused op served by its parts)
        # is timed as one.
        def wrapper(*a, **k):
            if depth[0] == 0:
                calls.append((name, function, a, k))
            depth[0] += 1
            try:
                return function(*a, **k)
            finally:
                depth[0] -= 1

        return wrapper

    originals = {name: function for name, function in originals.items() if function is not None}
    for name, function in originals.items():
        setattr(ops, name, recording(name, function))
    llm.model.runner.graphs = None  # eager from here on
    llm.forward.decode_batch(tokens, seqs)
    backend.synchronize()
    for name, function in originals.items():
        setattr(ops, name, function)

    groups: dict[str, list[float]] = defaultdict(list)
    weight_bytes: dict[str, int] = {}
    for name, function, a, k in calls:
        try:
            label, read = op_label_and_bytes(name, a, backend.to_numpy)
        except (IndexError, AttributeError):  # a call with its arguments by keyword: no bytes counted
            label, read = name, None
        if read is not None:
            weight_bytes[label] = read
        groups[label].append(graph_time(backend, lambda: function(*a, **k), calls_per_graph=REPEATS).median_us)

    total = sum(sum(values) for values in groups.values())
    print(f"shape {args.shape} batch {args.batch} context {args.context}")
    print(f"whole step (host clock):   {1e3 * step_time.median:8.3f} ms")
    for label, timing in sampled_steps.items():
        print(f"... sampling {label + ':':17}{1e3 * timing.median:8.3f} ms")
    if replay is not None:
        print(f"graph replay (events):     {1e3 * replay.median:8.3f} ms")
    if gaps:
        gap, busy = statistics.median(gaps), statistics.median(replays)
        print(f"gap between replays:       {gap:8.3f} ms median, {max(gaps):.3f} ms at most, over {len(gaps)} gaps "
              f"of a generate() call (replays {busy:.3f} ms median; {gap / (gap + busy):.0%} of a step is outside the graph: "
              "the sampler, the copies, and the wait for the host)")
    if gaps and gap_parts:
        print("between replays, with events around each piece (median GPU-clock ms from one mark to the next; "
              "a span holds the GPU's work, any wait for the host, and the marks' own records):")
        for label, values in gap_parts.items():
            print(f"    {label:40} {statistics.median(values):8.4f} ms over {len(values)} gaps")
    print(f"sum of op times:           {total / 1e3:8.3f} ms over {len(calls)} op calls")
    print(f"{'op':58} {'calls':>5} {'us/call':>9} {'total us':>9} {'GB/s':>7}   (GB/s: the bytes an op must read, "
          "op_label_and_bytes, over its time)")
    for label, values in sorted(groups.items(), key=lambda item: -sum(item[1])):
        per_call = statistics.median(values)
        rate = f"{weight_bytes[label] / per_call / 1e3:7.0f}" if label in weight_bytes else ""
        print(f"{label:58} {len(values):5d} {per_call:9.1f} {sum(values):9.1f} {rate}")


def op_label_and_bytes(name: str, a: tuple, to_numpy) -> tuple[str, int | None]:
    """The table's label of one op call (its name and the shapes that set its cost) and the bytes
    it must read from memory, or None where that is not counted: a product's weights; attention's
    cached keys and values (or latents) up to each row's position; the chosen experts' weights
    (each expert once); the router's weights; a Gated DeltaNet step's recurrent states, read and
    written; an embedding's rows. ``a`` holds the call's positional arguments; ``to_numpy``
    brings device arrays to the host."""
    shapes = "x".join(str(s) for s in a[0].shape)
    if name in ("linear", "linear_silu", "head_linear"):
        return f"{name} {shapes} @ {a[1].shape[0]}x{a[1].shape[1]}", a[1].nbytes
    if name == "rmsnorm_linear":
        return f"{name} {shapes} @ {a[5].shape[0]}x{a[5].shape[1]}", a[5].nbytes
    if name == "rmsnorm_mlp":
        return (f"{name} {shapes} @ {a[5].shape[0]}x{a[5].shape[1]} + {a[6].shape[0]}x{a[6].shape[1]}",
                a[5].nbytes + a[6].nbytes)
    if name == "paged_attention":
        k_cache, v_cache, batch, window = a[1], a[2], a[3], a[5]
        contexts = to_numpy(batch.positions).astype(np.int64) + 1
        if window:
            contexts = np.minimum(contexts, window)
        per_token = k_cache.shape[2] * (k_cache.shape[3] * k_cache.itemsize + v_cache.shape[3] * v_cache.itemsize)
        return f"paged_attention q {shapes}", int(contexts.sum()) * per_token
    if name == "latent_attention":
        latent, batch = a[1], a[2]
        contexts = to_numpy(batch.positions).astype(np.int64) + 1
        return f"latent_attention q {shapes}", int(contexts.sum()) * latent.shape[2] * latent.itemsize
    if name == "moe_experts":
        x, chosen, gate_up, down = a[0], a[1], a[3], a[4]
        experts = down.shape[0] // x.shape[1]
        used = len(np.unique(to_numpy(chosen)))
        return f"moe_experts {shapes} top-{chosen.shape[1]} of {experts}", used * (gate_up.nbytes + down.nbytes) // experts
    if name == "moe_route":
        return f"moe_route {shapes} over {a[1].shape[0]}", a[1].nbytes
    if name == "gdn_decode":
        state = a[6]
        return f"gdn_decode {shapes}", 2 * a[0].shape[0] * (state.nbytes // state.shape[0])
    if name == "embedding":
        return f"embedding {shapes}", len(a[1]) * a[0].shape[1] * a[0].itemsize
    return f"{name} {shapes}", None


@contextlib.contextmanager
def marking_between_replays(llm, runner):
    """CUDA events on the stream before and after each piece of a decode step's work outside its
    graph: the upload of the rung's metadata (``fill``, which carries the pending tokens' rows), the
    op that feeds those tokens in (``feed``) and the sampler (``sampler``); yields the list of
    ``(label, event)`` marks, in stream order."""
    import cupy

    stream = llm.backend.stream
    markers: list[tuple[str, object]] = []

    def mark(label: str) -> None:
        event = cupy.cuda.Event()
        event.record(stream)
        markers.append((label, event))

    def wrap(owner, name, label):
        original = getattr(owner, name)

        def wrapper(*a, **k):
            mark(f"{label} start")
            try:
                return original(*a, **k)
            finally:
                mark(f"{label} end")

        setattr(owner, name, wrapper)
        return original

    sampler = llm.engine.sampler
    restore = [(runner, "_fill", wrap(runner, "_fill", "fill")),
               (sampler, "sample_async", wrap(sampler, "sample_async", "sampler"))]
    ops = llm.backend.ops
    restore.append((ops, "feed_tokens", wrap(ops, "feed_tokens", "feed")))
    original_launch = runner._launch

    def launch(graph, rows):
        original_launch(graph, rows)
        markers.append(("replay end", runner.replay_events[-1][1]))
        # (the replay's start event was recorded just before it)
        markers.insert(len(markers) - 1, ("replay start", runner.replay_events[-1][0]))

    runner._launch = launch
    try:
        yield markers
    finally:
        del runner._launch  # the instance attribute; the class's method shows again
        for owner, name, original in restore:
            setattr(owner, name, original)


def split_gaps(replays, markers) -> dict[str, list[float]]:
    """The spans between consecutive marks from each replay's end to the next replay's start,
    by ``"from -> to"`` label, in milliseconds."""
    import cupy

    parts: dict[str, list[float]] = defaultdict(list)
    between = False
    for (a, first), (b, second) in zip(markers, markers[1:]):
        between = between or a == "replay end"
        if between:
            parts[f"{a} -> {b}"].append(cupy.cuda.get_elapsed_time(first, second))
        between = between and b != "replay start"
    return dict(parts)


if __name__ == "__main__":
    main()
