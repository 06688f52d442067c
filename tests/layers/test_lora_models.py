"""LoRA served end to end on the CPU against PEFT (``PeftModel`` on the transformers model):
every dense variant with adapters on all seven projections (rank and alpha patterns, rsLoRA),
trainable-token adapters on the embedding and the LM head, several adapters and the base model in
one batch (each row its solo result), slots reused across more adapters than slots, refusals (an
adapter whose config disagrees with its tensors or the model, through every entry point), the
warning for an adapter of another base model."""

from __future__ import annotations

import numpy as np
import pytest

from metrale import LLM, LoRARequest, SamplingParams
from metrale.errors import AdapterError, ConfigError
from metrale.testing.conformance import max_relative_error
from metrale.testing.hf import build_peft_adapter

PROMPT = [5, 17, 99, 3, 42, 8, 61, 23, 77, 14, 2, 90]
ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(checkpoint, folder, seed, **lora):
    return build_peft_adapter(checkpoint, folder, seed=seed, **lora)


def peft_logits(peft, tokens):
    import torch

    with torch.no_grad():
        return peft(torch.tensor([tokens])).logits[0].numpy()


def lora_llm(checkpoint, **options):
    return LLM(str(checkpoint), device="cpu", enable_lora=True, show_progress=False,
               **{"max_lora_rank": 16, "max_loras": 2, **options})


@pytest.mark.parametrize("rslora", [False, True])
def test_logits_equal_peft_s_for_every_dense_variant(dense_checkpoint, tmp_path, rslora):
    peft = make_adapter(dense_checkpoint, tmp_path / "a", 1, r=8, lora_alpha=16, target_modules=ALL_PROJECTIONS,
                        use_rslora=rslora, rank_pattern={"v_proj": 4, "down_proj": 12}, alpha_pattern={"o_proj": 5})
    with lora_llm(dense_checkpoint) as llm:
        got = llm.score(PROMPT, lora_request=LoRARequest("a", 1, tmp_path / "a"))
        base = llm.score(PROMPT)
    expected = peft_logits(peft, PROMPT)
    assert max_relative_error(got, expected) <= 1e-4
    assert max_relative_error(base, expected) > 1e-2  # the adapter changes the logits


@pytest.mark.parametrize("family", ["dense", "gdn"])
def test_steps_past_the_folded_rows_equal_peft_s(family_checkpoint_of, tmp_path, family):
    """A step of more rows than FOLDED_ROWS keeps each projection's own product and shrinks and
    expands apart (the op lora_linear): two long prompts of two adapters in one step."""
    from metrale.layers.lora import FOLDED_ROWS

    checkpoint = family_checkpoint_of(family)
    targets = ALL_PROJECTIONS if family == "dense" else MIXED_TARGETS["gdn"][0]
    pefts = [make_adapter(checkpoint, tmp_path / f"a{index}", 20 + index, r=8 >> index, lora_alpha=16,
                          target_modules=targets) for index in range(2)]
    requests = [LoRARequest(f"a{index}", index + 1, tmp_path / f"a{index}") for index in range(2)]
    prompts = [[int(t) for t in np.random.default_rng(index).integers(1, 100, FOLDED_ROWS + 10)] for index in range(2)]
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    with lora_llm(checkpoint, enable_prefix_caching=False) as llm:
        scored = [llm.score(prompt, lora_request=request) for prompt, request in zip(prompts, requests)]
        outputs = llm.generate(prompts, params, lora_request=requests)  # both prompts in one step
    for prompt, peft, got, output in zip(prompts, pefts, scored, outputs):
        expected = peft_logits(peft, prompt)
        assert max_relative_error(got, expected) <= 1e-4
        last = expected[-1] - expected[-1].max()
        last = last - np.log(np.exp(last).sum())
        top = output.outputs[0].logprobs[0]
        assert output.outputs[0].token_ids == [int(np.argmax(expected[-1]))]
        assert all(abs(top[t].logprob - last[t]) <= 1e-4 for t in top)


def test_trainable_token_rows_equal_peft_s(dense_checkpoints, tmp_path):
    checkpoint = dense_checkpoints["llama"]
    peft = make_adapter(checkpoint, tmp_path / "t", 2, r=4, lora_alpha=8, target_modules=["q_proj"],
                        trainable_token_indices={"embed_tokens": [5, 42, 100], "lm_head": [3, 17, 99]})
    with lora_llm(checkpoint) as llm:
        got = llm.score(PROMPT, lora_request=LoRARequest("t", 1, tmp_path / "t"))
    expected = peft_logits(peft, PROMPT)
    assert max_relative_error(got, expected) <= 1e-4


#: Per family, the projections of three adapters: all it serves (through PEFT), two, one.
MIXED_TARGETS = {
    "dense": (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], ["q_proj", "down_proj"],
              ["v_proj"]),
    "mla": (["q_proj", "kv_a_proj_with_mqa", "o_proj"], ["q_proj", "o_proj"], ["kv_a_proj_with_mqa"]),
    "gdn": (["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkvz", "in_proj_ba", "out_proj"], ["q_proj", "out_proj"],
            ["in_proj_qkvz"]),
}


@pytest.mark.parametrize("family", ["dense", "mla", "gdn"])
def test_a_mixed_batch_gives_each_row_its_solo_result(family_checkpoint_of, tmp_path, family):
    checkpoint = family_checkpoint_of(family, "qwen3" if family == "dense" else None)
    every, two, one = MIXED_TARGETS[family]
    requests = []
    for index, lora in enumerate([dict(r=8, lora_alpha=16, target_modules=every),
                                  dict(r=4, lora_alpha=4, target_modules=two, use_rslora=True),
                                  dict(r=2, lora_alpha=8, target_modules=one,
                                       trainable_token_indices={"embed_tokens": [5, 17, 61]})]):
        make_adapter(checkpoint, tmp_path / f"a{index}", 10 + index, **lora)
        requests.append(LoRARequest(f"a{index}", index + 1, tmp_path / f"a{index}"))
    prompts = [PROMPT, PROMPT[3:], PROMPT[:7], PROMPT[1:], PROMPT]
    adapters = [requests[0], requests[1], None, requests[2], requests[1]]
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2)
    with lora_llm(checkpoint, max_loras=3, enable_prefix_caching=False) as llm:
        together = llm.generate(prompts, params, lora_request=adapters)
        alone = [llm.generate([prompt], params, lora_request=[adapter])[0] for prompt, adapter in zip(prompts, adapters)]
    outputs = [o.outputs[0].token_ids for o in together]
    assert outputs == [o.outputs[0].token_ids for o in alone]
    assert [o.lora_request for o in together] == adapters
    assert len({tuple(t) for t in outputs[:2]}) == 2  # adapters change the continuation
    for mixed, solo in zip(together, alone):
        for a, b in zip(mixed.outputs[0].logprobs, solo.outputs[0].logprobs):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) <= 1e-4 for t in a)


def test_more_adapters_than_slots_take_turns(dense_checkpoints, tmp_path):
    checkpoint = dense_checkpoints["llama"]
    requests = []
    for index in range(3):
        make_adapter(checkpoint, tmp_path / f"a{index}", 20 + index, r=4, lora_alpha=8, target_modules=ALL_PROJECTIONS)
        requests.append(LoRARequest(f"a{index}", index + 1, tmp_path / f"a{index}"))
    params = SamplingParams(max_tokens=4, temperature=0.0)
    with lora_llm(checkpoint, max_loras=1) as llm:
        solo = [llm.generate([PROMPT], params, lora_request=r)[0].outputs[0].token_ids for r in requests]
        together = llm.generate([PROMPT] * 3, params, lora_request=requests)
        assert [o.outputs[0].token_ids for o in together] == solo
        assert llm.engine.check() == []
        assert llm.lora.holders(1) == 0


def test_prefix_cache_blocks_are_not_shared_across_adapters(dense_checkpoints, tmp_path):
    checkpoint = dense_checkpoints["llama"]
    make_adapter(checkpoint, tmp_path / "a", 3, r=4, lora_alpha=8, target_modules=ALL_PROJECTIONS)
    adapter = LoRARequest("a", 1, tmp_path / "a")
    prompt = list(range(1, 40))
    params = SamplingParams(max_tokens=1, temperature=0.0)
    with lora_llm(checkpoint, block_size=16) as llm:
        llm.generate([prompt], params)
        with_adapter = llm.generate([prompt], params, lora_request=adapter)[0]
        again = llm.generate([prompt], params, lora_request=adapter)[0]
    assert with_adapter.num_cached_tokens == 0  # the base model's blocks are not the adapter's
    assert again.num_cached_tokens == 32


def test_refusals(dense_checkpoints, tmp_path):
    checkpoint = dense_checkpoints["llama"]
    make_adapter(checkpoint, tmp_path / "a", 4, r=32, lora_alpha=8, target_modules=["q_proj"])
    with pytest.raises(ConfigError, match="enable_lora"):
        with LLM(str(checkpoint), device="cpu", show_progress=False) as llm:
            llm.generate([PROMPT], lora_request=LoRARequest("a", 1, tmp_path / "a"))
    with lora_llm(checkpoint) as llm:
        with pytest.raises(AdapterError, match="rank 32 is above max_lora_rank=16"):
            llm.generate([PROMPT], lora_request=LoRARequest("a", 1, tmp_path / "a"))
        make_adapter(checkpoint, tmp_path / "b", 5, r=4, lora_alpha=8, target_modules=["q_proj"])
        llm.generate([PROMPT], SamplingParams(max_tokens=1), lora_request=LoRARequest("b", 2, tmp_path / "b"))
        with pytest.raises(AdapterError, match="lora_int_id 2 already names adapter 'b'"):
            llm.generate([PROMPT], lora_request=LoRARequest("c", 2, tmp_path / "a"))
        assert llm.engine.check() == [] and llm.lora.holders(1) == 0 and llm.lora.holders(2) == 0


def spoilt_copy(source, folder, config=None, tensor=None):
    """A copy of the adapter folder ``source`` with ``config`` fields set and the first tensor
    whose name holds ``tensor`` made NaN at one value."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(source, folder)
    if config:
        path = folder / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if tensor:
        tensors = load_file(str(folder / "adapter_model.safetensors"))
        tensors[sorted(k for k in tensors if tensor in k)[0]][0, 0] = np.nan
        save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


#: Adapters whose config disagrees with their tensors or the model, and what their refusal says.
DISAGREEING_ADAPTERS = {
    "huge_r": (dict(config={"r": 1000000}), r"rank 1000000 is above max_lora_rank=16 \(r in adapter_config.json\)"),
    "other_r": (dict(config={"r": 8}), "r is 8 in adapter_config.json, but lora_A and lora_B have rank 4"),
    "nan_alpha": (dict(config={"lora_alpha": float("nan")}), "lora_alpha must be a finite positive number, got nan"),
    "no_such_module": (dict(config={"target_modules": ["c_attn"]}), r"target_modules \['c_attn'\] matches no module"),
    "unselected": (dict(config={"target_modules": ["k_proj"]}), "the tensors adapt model.layers.0.self_attn.q_proj"),
    "nan_weight": (dict(tensor="lora_B"), "lora_B.weight' holds 1 NaN or infinite values"),
}


@pytest.mark.parametrize("kind", sorted(DISAGREEING_ADAPTERS))
def test_an_adapter_that_disagrees_is_refused_by_add_lora_and_by_a_request(dense_checkpoints, tmp_path, kind):
    checkpoint = dense_checkpoints["llama"]
    make_adapter(checkpoint, tmp_path / "good", 14, r=4, lora_alpha=8, target_modules=["q_proj"])
    spoil, match = DISAGREEING_ADAPTERS[kind]
    bad = LoRARequest("bad", 1, spoilt_copy(tmp_path / "good", tmp_path / "bad", **spoil))
    with lora_llm(checkpoint) as llm:
        with pytest.raises(AdapterError, match=match):
            llm.add_lora(bad)
        with pytest.raises(AdapterError, match=match):
            llm.generate([PROMPT], SamplingParams(max_tokens=1), lora_request=bad)
        assert llm.list_loras() == [] and llm.engine.check() == [] and llm.lora.holders(1) == 0
        good = llm.generate([PROMPT], SamplingParams(max_tokens=1), lora_request=LoRARequest("good", 2, tmp_path / "good"))
        assert good[0].outputs[0].finish_reason == "length"


def test_an_adapter_that_disagrees_stops_an_engine_process_serving_it(dense_checkpoints, tmp_path):
    """``metrale serve --lora-modules``: the engine process reads its adapters at start."""
    from metrale.entrypoints.engine_process import EngineProcess

    checkpoint = dense_checkpoints["llama"]
    make_adapter(checkpoint, tmp_path / "good", 15, r=4, lora_alpha=8, target_modules=["q_proj"])
    bad = spoilt_copy(tmp_path / "good", tmp_path / "bad", config={"r": 1000000})
    with pytest.raises(AdapterError, match="rank 1000000 is above max_lora_rank=16"):
        EngineProcess(str(checkpoint), device="cpu", show_progress=False, enable_lora=True, max_lora_rank=16,
                      lora_modules=[LoRARequest("bad", 1, bad)])


def test_an_adapter_of_another_base_model_is_served_with_one_warning(dense_checkpoints, tmp_path, caplog):
    """The base model an adapter names (base_model_name_or_path) against the served checkpoint:
    another one gets one warning per adapter folder, however often the adapter is read; the
    served one, an empty or an absent name, none."""
    import logging

    from metrale.engine.lora_slots import LoraManager

    checkpoint = dense_checkpoints["llama"]
    make_adapter(checkpoint, tmp_path / "same", 16, r=4, lora_alpha=8, target_modules=["q_proj"])
    other = spoilt_copy(tmp_path / "same", tmp_path / "other", config={"base_model_name_or_path": "org/Another-8B"})
    empty = spoilt_copy(tmp_path / "same", tmp_path / "empty", config={"base_model_name_or_path": ""})
    with lora_llm(checkpoint) as llm:
        manager = LoraManager(llm.backend, llm.model.lora_layout, max_lora_rank=16, vocab_size=llm.vocab_size,
                              served_model=llm.checkpoint)
        with caplog.at_level(logging.WARNING, logger="metrale.engine.lora_slots"):
            for int_id, folder in enumerate([tmp_path / "same", empty, other, other], start=1):
                manager.resolve(LoRARequest(folder.name, int_id, folder))
            manager.remove(3)
            manager.resolve(LoRARequest("other", 3, other))
    warnings = [record.getMessage() for record in caplog.records if record.name == "metrale.engine.lora_slots"]
    assert len(warnings) == 1, warnings
    assert "'org/Another-8B'" in warnings[0] and str(checkpoint) in warnings[0] and "'other'" in warnings[0]


def test_a_decode_step_packed_as_its_graph_reads_it_equals_the_eager_step(dense_checkpoints, tmp_path):
    """The adapters' decode graph reads every row's adapter slot from the rung's packed metadata
    (metrale/runner/graphs.py); on the CPU backend, the same packing gives the eager logits."""
    from metrale.batch import ForwardBatch, Segment
    from metrale.runner.graphs import CudaGraphRunner, Rung, decode_buffer_length, decode_rung_batch, pack_decode
    from metrale.sequence import SequenceState

    checkpoint = dense_checkpoints["llama"]
    requests = []
    for index in range(2):
        make_adapter(checkpoint, tmp_path / f"a{index}", 30 + index, r=4, lora_alpha=8, target_modules=ALL_PROJECTIONS,
                     trainable_token_indices={"embed_tokens": [61], "lm_head": [5]})
        requests.append(LoRARequest(f"a{index}", index + 1, tmp_path / f"a{index}"))
    with lora_llm(checkpoint, block_size=4, max_model_len=128) as llm:
        model = llm.model
        seqs = []
        for prompt, adapter in zip((PROMPT, PROMPT[2:], PROMPT[5:]), (requests[0], None, requests[1])):
            seq = SequenceState.from_prompt(prompt)
            seq.adapter_slot = None if adapter is None else llm.lora.acquire(adapter)
            llm.forward.prefill(seq.tokens, seq)
            llm.cache.reserve(seq, seq.num_cached + 1)
            seqs.append(seq)
        batch = ForwardBatch.build([Segment(s, [61], s.num_cached, "last") for s in seqs], 4)
        eager = np.asarray(model.forward_batch(llm.backend.prepare_batch(batch)))
        runner = CudaGraphRunner(model, llm.backend)
        size, bucket = runner.rung_size(batch.num_rows), runner.context_bucket(batch.max_context)
        host = np.zeros(decode_buffer_length(size, runner.max_blocks), dtype=np.int32)
        pack_decode(host, size, runner.table_width(bucket), batch)
        rung = Rung(size, host, host, decode_rung_batch(host, size, runner.max_blocks, model.max_model_len))
        replayed = np.asarray(model.forward_batch(rung.bucket_batch(bucket, runner.table_width(bucket), lora=True)))
        base_path = np.asarray(model.forward_batch(rung.bucket_batch(bucket, runner.table_width(bucket))))
    np.testing.assert_allclose(replayed[:3], eager, rtol=1e-5, atol=1e-5)
    assert max_relative_error(base_path[0], eager[0]) > 1e-2  # the base model's graph would be wrong here
    np.testing.assert_allclose(base_path[1], eager[1], rtol=1e-5, atol=1e-5)


# PEFT (0.21) turns gate_proj / up_proj / down_proj targets of a model with fused experts into LoRA
# on the experts' parameters (refused below) and drops the dense MLPs' and shared experts': the
# PEFT adapters here target the attention, and the MLP updates are checked against merged weights.
MLA_PROJECTIONS = ["q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"]
GDN_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkvz", "in_proj_ba", "out_proj"]


def add_mlp_modules(checkpoint, folder, rank, alpha, seed):
    """Write an adapter of ``rank`` on every dense MLP and shared expert of ``checkpoint``'s model
    into ``folder`` (PEFT's names and format), with ``lora_alpha`` ``alpha``."""
    import json

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in ("gate_proj", "up_proj", "down_proj"):
            key = f"base_model.model.{name}"
            tensors[f"{key}.lora_A.weight"] = 0.2 * torch.randn((rank, module.in_features), generator=generator)
            tensors[f"{key}.lora_B.weight"] = 0.2 * torch.randn((module.out_features, rank), generator=generator)
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": alpha,
                                                            "target_modules": ["gate_proj", "up_proj", "down_proj"]}))
    assert tensors
    return model, tensors


def merged_logits(model, tensors, scale, tokens):
    """The logits of ``model`` with ``W + scale B A`` in every module ``tensors`` adapts."""
    import torch

    with torch.no_grad():
        for key in [k for k in tensors if k.endswith(".lora_A.weight")]:
            name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            module = model.get_submodule(name)
            module.weight += scale * tensors[key.replace("lora_A", "lora_B")] @ tensors[key]
        return model(torch.tensor([tokens])).logits[0].numpy()


@pytest.mark.parametrize("family", ["mla", "gdn"])
def test_mlp_and_shared_expert_updates_equal_the_merged_weights(family_checkpoint_of, tmp_path, family):
    checkpoint = family_checkpoint_of(family)
    model, tensors = add_mlp_modules(checkpoint, tmp_path / "a", rank=4, alpha=6, seed=9)
    shared = "shared_experts" if family == "mla" else "shared_expert"
    assert any(shared in key for key in tensors) and any(".mlp.gate_proj" in key for key in tensors)
    with lora_llm(checkpoint) as llm:
        got = llm.score(PROMPT, lora_request=LoRARequest("a", 1, tmp_path / "a"))
        base = llm.score(PROMPT)
    expected = merged_logits(model.eval(), tensors, 6 / 4, PROMPT)
    assert max_relative_error(got, expected) <= 1e-4
    assert max_relative_error(base, expected) > 1e-2


@pytest.mark.parametrize("variant", ["deepseek_v2", "deepseek_v3"])
def test_logits_equal_peft_s_for_the_mla_family(mla_checkpoints, tmp_path, variant):
    """Every projection of the latent attention but kv_b_proj, the dense layers' MLPs and the
    shared experts; the decode rows in the absorbed form too (the generated tokens' logits)."""
    checkpoint = mla_checkpoints[variant]
    peft = make_adapter(checkpoint, tmp_path / "a", 6, r=8, lora_alpha=16, target_modules=MLA_PROJECTIONS,
                        use_rslora=True, rank_pattern={"o_proj": 4}, trainable_token_indices={"embed_tokens": [5, 99]})
    request = LoRARequest("a", 1, tmp_path / "a")
    with lora_llm(checkpoint) as llm:
        got = llm.score(PROMPT, lora_request=request)
        decoded = llm.generate([PROMPT[:6]], SamplingParams(max_tokens=6, temperature=0.0, logprobs=1),
                               lora_request=request)[0].outputs[0]
    assert max_relative_error(got, peft_logits(peft, PROMPT)) <= 1e-4
    reference = peft_logits(peft, PROMPT[:6] + decoded.token_ids[:-1])[5:]
    assert decoded.token_ids == reference.argmax(-1).tolist()


def test_logits_equal_peft_s_for_the_gdn_family(gdn_checkpoint, tmp_path):
    """Gated attention (q_proj's query and gate rows apart in the fused weight), Gated DeltaNet
    projections, dense MLP and shared expert; prompt rows and decode rows."""
    peft = make_adapter(gdn_checkpoint, tmp_path / "a", 7, r=8, lora_alpha=8, target_modules=GDN_PROJECTIONS,
                        rank_pattern={"in_proj_ba": 2}, trainable_token_indices={"lm_head": [3, 17]})
    request = LoRARequest("a", 1, tmp_path / "a")
    with lora_llm(gdn_checkpoint) as llm:
        got = llm.score(PROMPT, lora_request=request)
        decoded = llm.generate([PROMPT[:6]], SamplingParams(max_tokens=6, temperature=0.0),
                               lora_request=request)[0].outputs[0]
    assert max_relative_error(got, peft_logits(peft, PROMPT)) <= 1e-4
    reference = peft_logits(peft, PROMPT[:6] + decoded.token_ids[:-1])[5:]
    assert decoded.token_ids == reference.argmax(-1).tolist()


@pytest.mark.parametrize("family, targets, match", [
    ("mla", ["kv_b_proj"], "kv_b_proj.*absorbed"),
    ("gdn", ["shared_expert_gate"], "shared_expert_gate.*not LoRA targets"),
    ("mla", ["gate_proj", "up_proj"], "target_parameters, such as MoE experts"),
    ("gdn", ["gate_proj", "up_proj", "down_proj"], "target_parameters, such as MoE experts"),
])
def test_projections_a_family_does_not_serve_are_refused(family_checkpoint_of, tmp_path, family, targets, match):
    checkpoint = family_checkpoint_of(family)
    make_adapter(checkpoint, tmp_path / "a", 8, r=4, lora_alpha=8, target_modules=targets)
    with lora_llm(checkpoint) as llm:
        with pytest.raises(AdapterError, match=match):
            llm.generate([PROMPT], lora_request=LoRARequest("a", 1, tmp_path / "a"))
        assert llm.engine.check() == []


def test_adapters_are_added_listed_and_removed(dense_checkpoints, tmp_path):
    checkpoint = dense_checkpoints["llama"]
    make_adapter(checkpoint, tmp_path / "a", 11, r=4, lora_alpha=8, target_modules=["q_proj"])
    make_adapter(checkpoint, tmp_path / "b", 12, r=4, lora_alpha=8, target_modules=["v_proj"])
    first, second = LoRARequest("a", 1, tmp_path / "a"), LoRARequest("b", 2, tmp_path / "b")
    params = SamplingParams(max_tokens=3, temperature=0.0)
    with lora_llm(checkpoint, max_loras=1) as llm:
        llm.add_lora(second)
        llm.add_lora(first)
        assert [r.lora_name for r in llm.list_loras()] == ["a", "b"]
        before = llm.generate([PROMPT], params, lora_request=first)[0].outputs[0].token_ids
        slot = llm.lora.acquire(first)
        with pytest.raises(AdapterError, match="in use"):
            llm.remove_lora(1)
        llm.lora.release(slot)
        assert llm.remove_lora(1) and not llm.remove_lora(1)
        assert [r.lora_name for r in llm.list_loras()] == ["b"]
        assert llm.lora.loaded() == {}  # its slot is free again
        # Read again on its next request, with the same result.
        assert llm.generate([PROMPT], params, lora_request=first)[0].outputs[0].token_ids == before
    with LLM(str(checkpoint), device="cpu", show_progress=False) as llm:
        assert llm.list_loras() == []
        with pytest.raises(ConfigError, match="enable_lora"):
            llm.remove_lora(1)


def test_a_mixed_step_packed_as_its_graph_reads_it_equals_the_eager_step(dense_checkpoints, tmp_path):
    """The adapters' mixed-step graph (decode rows of two adapters and the base model, a prompt
    chunk of a third) reads every row's slot from the padded packing; on the CPU backend, the
    same packing gives the eager logits."""
    from metrale.batch import ForwardBatch, Segment
    from metrale.runner.graphs import CudaGraphRunner, mixed_batch, mixed_buffer_length, mixed_logits_rows, pack_mixed
    from metrale.sequence import SequenceState

    checkpoint = dense_checkpoints["llama"]
    requests = []
    for index in range(3):
        make_adapter(checkpoint, tmp_path / f"a{index}", 40 + index, r=4, lora_alpha=8, target_modules=ALL_PROJECTIONS,
                     trainable_token_indices={"embed_tokens": [61, 8]})
        requests.append(LoRARequest(f"a{index}", index + 1, tmp_path / f"a{index}"))
    with lora_llm(checkpoint, block_size=4, max_model_len=128, max_loras=3) as llm:
        model, results = llm.model, []
        for packed in (False, True):
            seqs = []
            for prompt, adapter in zip((PROMPT, PROMPT[2:], PROMPT[5:], PROMPT[1:9]),
                                       (requests[0], None, requests[1], requests[2])):
                seq = SequenceState.from_prompt(prompt)
                seq.adapter_slot = None if adapter is None else llm.lora.acquire(adapter)
                seqs.append(seq)
            for seq in seqs[:3]:
                llm.forward.prefill(seq.tokens, seq)
                llm.cache.reserve(seq, seq.num_cached + 1)
            llm.cache.reserve(seqs[3], 8)
            segments = [Segment(s, [61], s.num_cached, "last") for s in seqs[:3]]
            batch = ForwardBatch.build(segments + [Segment(seqs[3], seqs[3].tokens, 0, "last")], 4)
            if packed:
                runner = CudaGraphRunner(model, llm.backend)
                decode, prompt = runner.mixed_shape(batch)
                host = np.zeros(mixed_buffer_length(decode, prompt, runner.max_blocks), dtype=np.int32)
                pack_mixed(host, decode, prompt, runner.max_blocks, batch)
                logits = np.asarray(model.forward_batch(
                    mixed_batch(host, decode, prompt, runner.max_blocks, model.max_model_len, lora=True)))
                results.append(logits[mixed_logits_rows(batch, decode)])
            else:
                results.append(np.asarray(model.forward_batch(llm.backend.prepare_batch(batch))))
            for seq in seqs:
                llm.cache.release(seq)
                if seq.adapter_slot is not None:
                    llm.lora.release(seq.adapter_slot)
    np.testing.assert_allclose(results[1], results[0], rtol=1e-5, atol=1e-5)


def test_an_adapter_that_cannot_be_loaded_at_admission_fails_its_request_only(dense_checkpoints, tmp_path):
    """An adapter read again at admission (after remove_lora) whose folder went bad meanwhile:
    that request finishes with an error, the others run, nothing stays held."""
    import shutil

    from metrale.engine.generation import make_request

    checkpoint = dense_checkpoints["llama"]
    make_adapter(checkpoint, tmp_path / "a", 13, r=4, lora_alpha=8, target_modules=["q_proj"])
    adapter = LoRARequest("a", 1, tmp_path / "a")
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    with lora_llm(checkpoint) as llm:
        llm.add_lora(adapter)
        requests = [make_request(i, None, PROMPT, params, 0) for i in range(2)]
        requests[0].lora, requests[0].seq.adapter_id = adapter, 1
        llm.remove_lora(1)
        shutil.rmtree(tmp_path / "a")
        for request in requests:
            llm.engine.add_request(request)
        while llm.engine.has_unfinished():
            llm.engine.step()
        assert requests[0].finish_reason == "error" and "could not be loaded" in requests[0].error
        assert requests[1].error is None and len(requests[1].generated) == 3
        assert llm.engine.check() == [] and llm.lora.holders(1) == 0
        assert llm.generate([PROMPT], params)[0].outputs[0].finish_reason == "length"  # still serving
