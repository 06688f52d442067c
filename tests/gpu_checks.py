"""Helpers of the GPU tests of whole models (``-m gpu``): loading a checkpoint on a backend, and the
MoE families' comparison of the cuda backend with the cpu backend where routing agrees."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from metrale import LLM

#: The tools that build the tiny checkpoints (their training corpus, ``tiny_corpus.py``, lives there).
TOOLS = Path(__file__).resolve().parents[1] / "tools" / "checkpoints"


def load(path, device, **options):
    return LLM(path, device=device, show_progress=False, **options)


#: Top-2 margin, relative to the row's largest |logit|, below which bf16 rounding may flip a greedy pick.
NEAR_TIE = 2e-2


def check_tokens_part_only_at_near_ties(reference, prompts, got, want, what, margin=NEAR_TIE):
    """Per prompt, ``got`` equals ``want`` (the greedy tokens of the LLM ``reference``), or the two
    part first right after a near-tie of ``reference``: a top-2 margin below ``margin``."""
    for number, (ids, ours, theirs) in enumerate(zip(prompts, got, want)):
        index = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if index is None:
            assert len(ours) == len(theirs), f"{what}: prompt {number} gave {len(ours)} tokens against {len(theirs)}"
            continue
        logits = reference.score(list(ids) + list(theirs[:index]))[-1]
        top2 = np.sort(logits)[-2:]
        tie = float(top2[1] - top2[0]) / float(np.abs(logits).max())
        print(f"{what}: prompt {number} parts at token {index}, where the top-2 margin is {tie:.3g}")
        assert tie < margin, f"{what}: prompt {number} parts at token {index} although the top-2 margin is {tie:.3g}"


def held_out_ids(llm, count: int = 256) -> list[int]:
    """The first ``count`` token ids of the tiny checkpoints' held-out text, encoded by ``llm``."""
    sys.path.insert(0, str(TOOLS))
    try:
        import tiny_corpus
    finally:
        sys.path.remove(str(TOOLS))
    _, held_out = tiny_corpus.extract()
    ids: list[int] = []
    for text in held_out:
        ids += llm.encode(text)
        if len(ids) >= count:
            break
    return ids[:count]


def scored_with_routes(path, device, ids, **options):
    """Teacher-forced logits and, per MoE layer, each position's chosen experts (sorted)."""
    llm = load(path, device, **options)
    routes = []
    route = llm.model.route

    def recording(moe, h):
        chosen, weights = route(moe, h)
        routes.append(np.sort(llm.backend.to_numpy(chosen).astype(np.int64), axis=1))
        return chosen, weights

    llm.model.route = recording
    return llm.score(ids), routes


def transformers_bf16_rows(path, ids, cpu, device="cuda"):
    """Per position, the largest logit error of transformers' own bf16 run on the GPU against the
    float32 logits ``cpu``, relative to their largest magnitude: what bf16 costs the reference."""
    return transformers_bf16_run(path, ids, cpu, device=device)[0]


#: transformers' router modules of the MoE families (their outputs' first element holds each
#: position's expert logits or scores).
ROUTER_SUFFIXES = (".mlp.router", ".mlp.gate", ".block_sparse_moe.gate")


def transformers_bf16_run(path, ids, cpu, device="cuda"):
    """``(rows, routes, picks)``: :func:`transformers_bf16_rows`, per MoE layer each position's chosen
    experts (sorted) in that bf16 run, read from the top-k of its routers' outputs, and each
    position's top-1 token in that run."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    config = json.loads((Path(path) / "config.json").read_text())
    experts = config.get("num_local_experts", config.get("num_experts"))
    top_k = config.get("num_experts_per_tok")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    routes = []

    def record(module, inputs, output):
        logits = output[0] if isinstance(output, tuple) else output
        if experts and top_k and logits.shape[-1] == experts:
            chosen = torch.topk(logits.float().reshape(-1, experts), top_k, dim=-1).indices
            routes.append(np.sort(chosen.cpu().numpy().astype(np.int64), axis=1))

    for name, module in model.named_modules():
        if name.endswith(ROUTER_SUFFIXES):
            module.register_forward_hook(record)
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=device)).logits[0].float().cpu().numpy()
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return np.abs(logits - cpu).max(axis=1) / np.abs(cpu).max(), routes, logits.argmax(-1)


def quantized_reference_bf16_rows(source, quantized, ids, cpu, quantization=None, device="cuda", dtype="bfloat16"):
    """Per position, the largest logit error of a bf16 run of the same quantized math in
    transformers against the float32 logits ``cpu`` (relative to their largest magnitude): what
    bf16 costs the quantized reference. transformers runs the full-precision checkpoint ``source``
    with each matrix the checkpoint ``quantized`` holds quantized (``quantization``: an online
    method) replaced by its dequantized value, and each such product's input quantized under its
    activation scheme (:func:`metrale.kernels.quantized.quantize_activations`). ``device`` and
    ``dtype`` move the reference's run (float32 on the cpu: the same math as the cpu backend)."""
    import torch
    from transformers import AutoModelForCausalLM

    from metrale.kernels.quantized import dequantize, quantize_activations
    from metrale.loading.checkpoint import Checkpoint

    checkpoint = Checkpoint(quantized, quantization=quantization)
    dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype).to(device).eval()
    model.config._experts_implementation = "eager"  # the experts' products through F.linear
    params = dict(model.named_parameters())
    schemes = {}
    with torch.no_grad():
        # A quantized {module}.weight may be stored as other tensors of its module (codes, scales).
        names = set(checkpoint.names()) | {stored.rsplit(".", 1)[0] + ".weight" for stored in checkpoint.names()}
        for name in sorted(names):
            if checkpoint.is_quantized(name) and not multi_token_prediction_tensor(name, model.config):
                weight = checkpoint.quantized(name)
                target = torch_weight(params, name)
                target.copy_(torch.from_numpy(dequantize(weight)).to(target.device, dtype))
                schemes[target.data_ptr()] = weight
    linear = torch.nn.functional.linear

    def quantized_linear(x, weight, bias=None):
        scheme = schemes.get(weight.data_ptr())
        if scheme is not None and scheme.activations != "weight_only":
            rows = x.reshape(-1, x.shape[-1]).float().cpu().numpy()
            x = torch.from_numpy(quantize_activations(rows, scheme)).to(x.device, x.dtype).reshape(x.shape)
        return linear(x, weight, bias)

    torch.nn.functional.linear = quantized_linear
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids], device=device)).logits[0].float().cpu().numpy()
    finally:
        torch.nn.functional.linear = linear
    assert schemes, f"{quantized}: no quantized matrix reached the reference"
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return np.abs(logits - cpu).max(axis=1) / np.abs(cpu).max()


def multi_token_prediction_tensor(name, config):
    """Whether checkpoint tensor ``name`` belongs to a multi-token-prediction module, which
    transformers does not load (DeepSeek's layers past ``num_hidden_layers``, Qwen3-Next's ``mtp.*``):
    the reference's forward never reads it."""
    import re

    layer = re.match(r"model\.layers\.(\d+)\.", name)
    return name.startswith("mtp.") or (layer is not None and int(layer.group(1)) >= config.num_hidden_layers)


def torch_weight(params, name):
    """The transformers parameter (or the slice of one) holding checkpoint tensor ``name``: experts
    stored one by one in the checkpoint are slices of transformers' stacked ``gate_up_proj`` [E, 2I,
    H] and ``down_proj`` [E, H, I]."""
    import re

    if name in params:
        return params[name]
    match = re.fullmatch(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight", name)
    if match is None:
        raise KeyError(f"no transformers parameter holds {name}")
    prefix, expert, kind = match.group(1), int(match.group(2)), match.group(3)
    if kind == "down_proj":
        return params[f"{prefix}.down_proj"][expert]
    stacked = params[f"{prefix}.gate_up_proj"][expert]
    half = stacked.shape[0] // 2
    return stacked[:half] if kind == "gate_proj" else stacked[half:]


def check_calibrated(rows, reference, what, percentiles=(50, 99)):
    """The error's median and upper percentile (the 99th unless ``percentiles`` names another) over
    the positions given exceed the reference's own bf16 error by at most 25 %."""
    ours = [float(np.percentile(rows, p)) for p in percentiles]
    theirs = [float(np.percentile(reference, p)) for p in percentiles]
    print(f"{what}: error percentiles {percentiles}: {ours[0]:.3g} / {ours[1]:.3g} (max {float(np.max(rows)):.3g}); "
          f"the reference in bf16: {theirs[0]:.3g} / {theirs[1]:.3g} (max {float(np.max(reference)):.3g})")
    assert ours[0] <= 1.25 * theirs[0] and ours[1] <= 1.25 * theirs[1], f"{what}: {ours} against {theirs}"


def check_against_cpu_where_routing_agrees(path, ids, what, calibrate=False, source=None, **options):
    """bf16 tolerance and >= 99% top-1 agreement on the positions whose experts agree.

    Routing is discontinuous (docs/families.rst, "Routed experts"): where bf16 rounding flips an expert choice the
    position's output legitimately differs, so those positions (at most 5 %) are left out;
    everywhere else the error must be bf16 rounding: at most 2e-2 (relative to the largest
    logit) at 99 % of those positions and 5e-2 at any, since the random DeepSeek-V3 shape
    sharpens attention (its YaRN mscale multiplies the softmax scale by 1.67) and so bf16 noise.
    With ``calibrate`` the bounds are instead what bf16 costs transformers on the same checkpoint
    (:func:`check_calibrated_routing`), and the top-1 agreement may fall short of transformers'
    own bf16 run's by at most 2 points (and need not exceed 99 %). With ``source`` (a quantized checkpoint, or
    ``options`` naming an online quantization, whose full-precision weights ``source`` holds) the
    bound is what bf16 costs the same quantized math (:func:`quantized_reference_bf16_rows`), and
    the routing may differ wherever that noise flips a choice.
    Agreement counts those positions whose top-2 margin on the cpu exceeds 2e-2 of the largest
    logit (at least half of them): random weights leave many near-ties that bf16 flips."""
    cpu, cpu_routes = scored_with_routes(path, "cpu", ids, **options)
    gpu, gpu_routes = scored_with_routes(path, "cuda", ids, **options)
    same_route = same_routes(cpu_routes, gpu_routes)
    scale = np.abs(cpu).max()
    rows = np.abs(gpu - cpu).max(axis=1) / scale
    error = float(rows[same_route].max())
    typical = float(np.percentile(rows[same_route], 99))
    top2 = np.sort(cpu, axis=-1)[:, -2:]
    counted = same_route & ((top2[:, 1] - top2[:, 0]) > 2e-2 * scale)
    agreement = float((gpu.argmax(-1) == cpu.argmax(-1))[counted].mean())
    print(f"{what}: {int((~same_route).sum())} of {len(ids)} positions routed differently; relative error "
          f"{typical:.3g} (99th percentile) / {error:.3g} (max) where routing agrees ({rows.max():.3g} overall); "
          f"top-1 agreement {agreement:.4f} over {int(counted.sum())} positions")
    if source is not None:
        reference = quantized_reference_bf16_rows(source, path, ids, cpu, options.get("quantization"))
        check_calibrated(rows, reference, what)
        return
    if calibrate:
        reference_picks = check_calibrated_routing(path, ids, cpu, cpu_routes, rows, same_route, what)
        theirs = float((reference_picks == cpu.argmax(-1))[counted].mean())
        print(f"{what}: top-1 agreement with float32 there {agreement:.4f}; transformers' bf16 run {theirs:.4f}")
        assert counted.sum() >= 32 and agreement >= min(0.99, theirs - 0.02), f"{what}: top-1 agreement {agreement:.4f}"
        return
    assert same_route.mean() >= 0.95, f"{what}: routing differs at {int((~same_route).sum())} positions"
    assert typical <= 2e-2 and error <= 5e-2, f"{what}: relative error {typical:.3g} / {error:.3g}"
    assert counted.sum() >= 0.5 * len(ids) and agreement >= 0.99, f"{what}: top-1 agreement {agreement:.4f}"


def same_routes(first, second):
    """Per position, whether two runs chose the same experts in every MoE layer."""
    assert len(first) == len(second), f"{len(first)} MoE layers recorded against {len(second)}"
    return np.all([(a == b).all(axis=1) for a, b in zip(first, second)], axis=0)


#: Positions after a routing flip whose error is left out of the calibrated comparison: a flipped
#: position's keys and values reach the positions after it through attention. transformers' own
#: bf16 run of the Mixtral test checkpoint shows it: its worst positions routed alike all sit a
#: few positions after one of its flips.
FLIP_REACH = 16


def after_flips(flipped, reach=FLIP_REACH):
    """Per position, whether a position at most ``reach`` before it (itself included) flipped."""
    near = np.zeros(len(flipped), dtype=bool)
    for position in np.flatnonzero(flipped):
        near[position : position + reach + 1] = True
    return near


def check_calibrated_routing(path, ids, cpu, cpu_routes, rows, same_route, what, device="cuda"):
    """Routing held to what bf16 does to transformers' own routing, the error to what bf16 costs it.

    Where bf16 rounding flips an expert choice a position's output legitimately differs, and how
    often that happens is the checkpoint's (random routers leave near-ties; on some shapes
    transformers' own bf16 run flips half the positions). So: the positions routed unlike the
    float32 run may exceed transformers' own count by at most 5 % of the positions, and the error's
    median and 90th percentile may exceed transformers' by at most 25 % (:func:`check_calibrated`)
    on the positions both runs route as the float32 run does and that no flip of either run
    reaches (:data:`FLIP_REACH`): a position routed alike still attends to the flipped ones before
    it, so near flips the error follows how many flips a run had, which the first bound holds.
    Where flips leave fewer than a quarter of the positions unreached, all positions routed alike
    are compared. Returns transformers' top-1 tokens (:func:`transformers_bf16_run`)."""
    reference_rows, reference_routes, reference_picks = transformers_bf16_run(path, ids, cpu, device=device)
    reference_same = same_routes(cpu_routes, reference_routes)
    ours, theirs = int((~same_route).sum()), int((~reference_same).sum())
    print(f"{what}: routed unlike float32 at {ours} positions; transformers' bf16 run at {theirs}")
    assert ours <= theirs + 0.05 * len(ids), f"{what}: routing differs at {ours} positions (transformers: {theirs})"
    both = same_route & reference_same
    assert both.sum() >= 0.25 * len(ids), f"{what}: only {int(both.sum())} positions routed alike by all runs"
    unreached = both & ~after_flips(~both)
    compared = unreached if unreached.sum() >= 0.25 * len(ids) else both
    print(f"{what}: {int(compared.sum())} positions compared ({int(unreached.sum())} routed alike and no flip reaches)")
    check_calibrated(rows[compared], reference_rows[compared], what, percentiles=(50, 90))
    return reference_picks


def check_calibrated_against_cpu(path, ids, what, **options):
    """The cuda backend's logits against the cpu backend's, per position the largest error relative
    to the largest logit, held to what bf16 costs transformers' own run of the same checkpoint
    (:func:`check_calibrated`); top-1 agreement where the cpu's top-2 margin is clear."""
    cpu = load(path, "cpu", **options).score(ids)
    gpu = load(path, "cuda", **options).score(ids)
    scale = np.abs(cpu).max()
    rows = np.abs(gpu - cpu).max(axis=1) / scale
    check_calibrated(rows, transformers_bf16_rows(path, ids, cpu), what)
    top2 = np.sort(cpu, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 2e-2 * scale
    agreement = float((gpu.argmax(-1) == cpu.argmax(-1))[clear].mean())
    assert clear.sum() >= 0.5 * len(ids) and agreement >= 0.99, f"{what}: top-1 agreement {agreement:.4f}"


def check_fp8_cache_against_cpu(path, ids, what):
    """An FP8 KV cache on the GPU against the CPU's, where routing agrees: within bf16's bounds
    (2e-2 at the 99th percentile, 5e-2 at most, relative to the largest logit), or within 25 % more
    than what rounding the cached rows to bf16 before they are quantized costs the CPU's own FP8
    run. The GPU quantizes rows that bf16 kernels computed, the CPU their float32 values; a value
    near the midpoint of two E4M3 codes (2^-4 apart, relative) takes either code after bf16's
    2^-9, so the cache turns bf16 noise into code-sized steps, more of them the wider a row (an MLA
    latent row is 576 values under one scale). Returns the bound on any position's error."""
    from metrale.kernels import kv_cache_fp8
    from metrale.loading.checkpoint import bf16_to_float32, float32_to_bf16

    cpu, cpu_routes = scored_with_routes(path, "cpu", ids, kv_cache_dtype="fp8")
    gpu, gpu_routes = scored_with_routes(path, "cuda", ids, kv_cache_dtype="fp8")
    quantize = kv_cache_fp8.Fp8CacheArray.quantize

    def quantize_rounded(cache, rows):
        return quantize(cache, bf16_to_float32(float32_to_bf16(np.asarray(rows, dtype=np.float32))))

    kv_cache_fp8.Fp8CacheArray.quantize = quantize_rounded
    try:
        rounded, rounded_routes = scored_with_routes(path, "cpu", ids, kv_cache_dtype="fp8")
    finally:
        kv_cache_fp8.Fp8CacheArray.quantize = quantize
    scale = np.abs(cpu).max()
    # (A model without routed experts records no routes: every position agrees.)
    agree = np.broadcast_to(same_routes(cpu_routes, gpu_routes) & same_routes(cpu_routes, rounded_routes), (len(ids),))
    ours = np.abs(gpu - cpu).max(axis=1)[agree] / scale
    theirs = np.abs(rounded - cpu).max(axis=1)[agree] / scale
    bounds = max(2e-2, 1.25 * float(np.percentile(theirs, 99))), max(5e-2, 1.25 * float(theirs.max()))
    print(f"{what}: {int((~agree).sum())} of {len(ids)} positions routed differently; relative error "
          f"{np.percentile(ours, 99):.3g} (99th percentile) / {ours.max():.3g} (max); the CPU's with rows rounded "
          f"to bf16 before quantization: {np.percentile(theirs, 99):.3g} / {theirs.max():.3g}")
    assert agree.mean() >= 0.95, f"{what}: routing differs at {int((~agree).sum())} positions"
    assert np.percentile(ours, 99) <= bounds[0] and ours.max() <= bounds[1], f"{what}: {ours.max():.3g} against {bounds}"
    return bounds[1]
