"""Train the tiny checkpoints shipped in ``metrale/models`` (tiny-dense, tiny-mla, tiny-gdn).

Reproducible from this script, a seed and the corpus: the corpus is extracted from the running
interpreter's standard library (``tools/checkpoints/tiny_corpus.py``) or read from a file written by an
earlier run (``--corpus-file``); its SHA-256 goes into every model card. Training runs with
deterministic algorithms, in float32, so the same seed on the same machine gives the same loss
curve. Needs torch, transformers (>= 5.10) and tokenizers.

    python tools/checkpoints/train_tiny_models.py --models tiny-dense --steps 1500 --device cuda

``--mtp-steps N`` then trains a multi-token-prediction layer on the frozen tiny-mla (DeepSeek-V3's
``model.layers.{L}.*``) or tiny-gdn (Qwen3-Next's ``mtp.*``) and writes it into the checkpoint;
``--mtp-for FOLDER --mtp-steps N`` does only that, for an existing checkpoint (its weights and
tokenizer kept)::

    python tools/checkpoints/train_tiny_models.py --mtp-for metrale/models/tiny-mla --mtp-steps 400 --device cpu
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_corpus  # noqa: E402

SEPARATOR = tiny_corpus.SEPARATOR
MODELS = ("tiny-dense", "tiny-mla", "tiny-gdn")


# ------------------------------------------------------------------------------- corpus


def load_corpus(corpus_file: Path | None) -> dict:
    if corpus_file is not None and corpus_file.exists():
        return json.loads(corpus_file.read_text())
    train, held_out = tiny_corpus.extract()
    corpus = {"python": sys.version.split()[0], "train": train, "held_out": held_out}
    if corpus_file is not None:
        corpus_file.parent.mkdir(parents=True, exist_ok=True)
        corpus_file.write_text(json.dumps(corpus))
    return corpus


def limited(corpus: dict, max_docs: int | None) -> dict:
    """The corpus, or its first ``max_docs`` training documents and a tenth as many held out."""
    if max_docs is None:
        return corpus
    return {**corpus, "train": corpus["train"][:max_docs], "held_out": corpus["held_out"][: max(1, max_docs // 10)]}


def corpus_digest(corpus: dict) -> str:
    digest = hashlib.sha256()
    for text in corpus["train"] + [SEPARATOR] + corpus["held_out"]:
        digest.update(text.encode())
        digest.update(b"\0")
    return digest.hexdigest()


# ---------------------------------------------------------------------------- tokenizer


def train_tokenizer(documents: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[SEPARATOR],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    eos = tokenizer.token_to_id(SEPARATOR)
    # Every encoded prompt starts with the separator, as every training document does.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{SEPARATOR} $A", pair=f"{SEPARATOR} $A {SEPARATOR} $B", special_tokens=[(SEPARATOR, eos)]
    )
    return tokenizer


def token_stream(tokenizer, documents: list[str]):
    import torch

    eos = tokenizer.token_to_id(SEPARATOR)
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(documents, add_special_tokens=False):
        ids.append(eos)
        ids.extend(encoding.ids)
    ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


# ------------------------------------------------------------------------------- models


def model_config(name: str, vocab_size: int, eos: int):
    """The transformers config of each tiny model (sized to stay under 3 MB in bf16)."""
    from transformers import DeepseekV3Config, LlamaConfig, Qwen3NextConfig

    common = dict(
        vocab_size=vocab_size, hidden_size=128, max_position_embeddings=1024, rms_norm_eps=1e-6,
        bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, tie_word_embeddings=True,
    )
    if name == "tiny-dense":
        return LlamaConfig(
            **common, intermediate_size=320, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    if name == "tiny-mla":
        return DeepseekV3Config(
            **common, experts_implementation="eager", intermediate_size=320, moe_intermediate_size=64, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=32,
            qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
            n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
            norm_topk_prob=True, rope_interleave=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    if name == "tiny-gdn":
        return Qwen3NextConfig(
            **common, experts_implementation="eager", intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32,
            linear_num_key_heads=2, linear_num_value_heads=4, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=48, shared_expert_intermediate_size=48, norm_topk_prob=True,
            layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            mlp_only_layers=[], decoder_sparse_step=1,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        )
    raise SystemExit(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


def model_class(name: str):
    from transformers import DeepseekV3ForCausalLM, LlamaForCausalLM, Qwen3NextForCausalLM

    return {"tiny-dense": LlamaForCausalLM, "tiny-mla": DeepseekV3ForCausalLM, "tiny-gdn": Qwen3NextForCausalLM}[name]


# ----------------------------------------------------------------------------- training


def evaluate(model, stream, seq_len: int, device) -> float:
    """Mean next-token cross-entropy over the held-out stream, in non-overlapping windows."""
    import torch

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, stream.numel() - 1, seq_len):
            window = stream[start : start + seq_len + 1].to(device)
            if window.numel() < 2:
                break
            logits = model(window[None, :-1]).logits[0].float()
            loss = torch.nn.functional.cross_entropy(logits, window[1:], reduction="sum")
            total += float(loss)
            count += window.numel() - 1
    model.train()
    return total / count


def unigram_cross_entropy(train_stream, held_out_stream, vocab_size: int) -> float:
    """Held-out cross-entropy of an add-one-smoothed unigram model of the training tokens."""
    import torch

    counts = torch.bincount(train_stream, minlength=vocab_size).double() + 1.0
    log_probs = torch.log(counts / counts.sum())
    return float(-log_probs[held_out_stream[1:]].mean())


def mtp_module(model):
    """A multi-token-prediction module for ``model`` (DeepSeek-V3 or Qwen3-Next), as Metrale runs
    it: for row ``i`` of a sequence, a projection of ``[norm_e(embed(t[i+1])); norm_h(h[i])]``
    (the embedding half first; ``h`` the main model's hidden states after its final norm), one
    decoder layer over the rows (causal, RoPE at position ``i``; a full-attention layer for
    Qwen3-Next), a final norm and the main model's LM head: the logits of ``t[i+2]``. DeepSeek-V3
    names the parts ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``; Qwen3-Next
    ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``, ``fc``, ``norm`` (zero-centred norms)."""
    import torch

    config = model.config
    hidden = config.hidden_size
    if config.model_type == "qwen3_next":
        from transformers.models.qwen3_next import modeling_qwen3_next as family

        norm_class, layer_class = family.Qwen3NextRMSNorm, family.Qwen3NextDecoderLayer
        layer_index = config.layer_types.index("full_attention")
    else:
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as family

        norm_class, layer_class = family.DeepseekV3RMSNorm, family.DeepseekV3DecoderLayer
        layer_index = config.num_hidden_layers

    class Mtp(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding_norm = norm_class(hidden, eps=config.rms_norm_eps)
            self.hidden_norm = norm_class(hidden, eps=config.rms_norm_eps)
            self.projection = torch.nn.Linear(2 * hidden, hidden, bias=False)
            self.block = layer_class(config, layer_idx=layer_index)
            self.head_norm = norm_class(hidden, eps=config.rms_norm_eps)

        def forward(self, next_tokens, hidden_states):
            embeds = model.model.embed_tokens(next_tokens)
            x = self.projection(torch.cat([self.embedding_norm(embeds), self.hidden_norm(hidden_states)], dim=-1))
            positions = torch.arange(x.shape[1], device=x.device)[None]
            # An additive causal mask [1, 1, T, T]: what every transformers release's eager and
            # SDPA attention take (the mask helpers' signatures differ between releases).
            mask = torch.full((x.shape[1], x.shape[1]), float("-inf"), dtype=x.dtype, device=x.device).triu(1)[None, None]
            x = self.block(x, attention_mask=mask, position_ids=positions,
                           position_embeddings=model.model.rotary_emb(x, positions))
            return model.lm_head(self.head_norm(x))

    mtp = Mtp()
    mtp.apply(model._init_weights)  # (the decoder layer's expert weights are created uninitialised)
    return mtp


def mtp_tensors(mtp, config) -> dict:
    """The module's weights under a checkpoint's MTP names, experts one by one as the decoder
    layers' are saved, no head of its own (the LM head is the main model's): DeepSeek-V3's
    ``model.layers.{num_hidden_layers}.*``, Qwen3-Next's ``mtp.*`` (its layer ``mtp.layers.0``)."""
    if config.model_type == "qwen3_next":
        prefix, layer = "mtp", "mtp.layers.0"
        parts = {"embedding_norm": "pre_fc_norm_embedding", "hidden_norm": "pre_fc_norm_hidden", "projection": "fc",
                 "head_norm": "norm"}
    else:
        prefix = layer = f"model.layers.{config.num_hidden_layers}"
        parts = {"embedding_norm": "enorm", "hidden_norm": "hnorm", "projection": "eh_proj",
                 "head_norm": "shared_head.norm"}
    tensors = {}
    for name, value in mtp.block.state_dict().items():
        if name == "mlp.experts.gate_up_proj":  # [E, 2I, H]: per expert, the gate rows, then the up rows
            units = value.shape[1] // 2
            for expert, weight in enumerate(value):
                tensors[f"{layer}.mlp.experts.{expert}.gate_proj.weight"] = weight[:units]
                tensors[f"{layer}.mlp.experts.{expert}.up_proj.weight"] = weight[units:]
        elif name == "mlp.experts.down_proj":  # [E, H, I]
            for expert, weight in enumerate(value):
                tensors[f"{layer}.mlp.experts.{expert}.down_proj.weight"] = weight
        else:
            tensors[f"{layer}.{name}"] = value
    for attribute, name in parts.items():
        tensors[f"{prefix}.{name}.weight"] = getattr(mtp, attribute).weight
    return {name: value.detach().to("cpu").contiguous() for name, value in tensors.items()}


def mtp_loss(model, mtp, window):
    """Cross-entropy of the MTP logits of rows ``0 .. n-2`` of ``window[:, :-1]`` against the
    tokens two ahead; top-1 accuracy beside it. The main model runs without gradients."""
    import torch

    inputs = window[:, :-1]
    with torch.no_grad():
        hidden = model.model(inputs).last_hidden_state
    logits = mtp(inputs[:, 1:], hidden[:, :-1]).float()
    targets = window[:, 2:]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    accuracy = (logits.argmax(-1) == targets).float().mean()
    return loss, accuracy


def train_mtp(model, args, train_stream, held_out_stream) -> dict:
    """Train an MTP module on the frozen ``model`` for ``args.mtp_steps`` steps (the base run's
    batch, window, learning-rate schedule and seed); held-out cross-entropy and top-1 accuracy of
    the kept weights."""
    import torch

    device = torch.device(args.device)
    model = model.float()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    torch.manual_seed(args.seed + 1)
    mtp = mtp_module(model).to(device)
    optimizer = torch.optim.AdamW(mtp.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    generator = torch.Generator().manual_seed(args.seed + 1)
    steps, warmup = args.mtp_steps, max(1, args.mtp_steps // 20)
    curve = []
    for step in range(1, steps + 1):
        lr = args.lr * min(1.0, step / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, train_stream.numel() - args.seq_len - 1, (args.batch,), generator=generator)
        window = torch.stack([train_stream[s : s + args.seq_len + 1] for s in starts.tolist()]).to(device)
        loss, _ = mtp_loss(model, mtp, window)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(mtp.parameters(), 1.0)
        optimizer.step()
        curve.append(round(float(loss.detach()), 4))
    mtp.eval()
    total, correct, count = 0.0, 0.0, 0
    with torch.no_grad():
        for start in range(0, held_out_stream.numel() - 2, args.seq_len):
            window = held_out_stream[start : start + args.seq_len + 1].to(device)[None]
            if window.shape[1] < 3:
                break
            loss, accuracy = mtp_loss(model, mtp, window)
            rows = window.shape[1] - 2
            total, correct, count = total + float(loss) * rows, correct + float(accuracy) * rows, count + rows
    print(f"MTP: {steps} steps, loss {curve[-1]:.4f}, held-out {total / count:.4f}, top-1 {correct / count:.3f}",
          flush=True)
    return {"mtp": mtp.to(torch.bfloat16), "mtp_curve": curve, "mtp_held_out_ce": total / count,
            "mtp_top1": correct / count}


def train(name: str, args, tokenizer, train_stream, held_out_stream, corpus: dict, digest: str) -> dict:
    import torch

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    eos = tokenizer.token_to_id(SEPARATOR)
    config = model_config(name, tokenizer.get_vocab_size(), eos)
    model = model_class(name)(config).to(device)
    model.train()
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    generator = torch.Generator().manual_seed(args.seed)
    warmup = max(1, args.steps // 20)
    curve, evals = [], []
    best = None
    started = time.time()
    for step in range(1, args.steps + 1):
        lr = args.lr * min(1.0, step / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, train_stream.numel() - args.seq_len - 1, (args.batch,), generator=generator)
        batch = torch.stack([train_stream[s : s + args.seq_len + 1] for s in starts.tolist()]).to(device)
        logits = model(batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        curve.append(round(float(loss.detach()), 4))
        if step % args.eval_every == 0 or step == args.steps:
            evals.append((step, round(evaluate(model, held_out_stream, args.seq_len, device), 4)))
            print(f"{name} step {step}/{args.steps} loss {curve[-1]:.4f} held-out {evals[-1][1]:.4f} "
                  f"({time.time() - started:.0f} s)", flush=True)
            if best is None or evals[-1][1] < best[1]:
                best = (step, evals[-1][1], {k: v.detach().clone() for k, v in model.state_dict().items()})
    # Keep the weights of the evaluation with the lowest held-out loss (early stopping).
    model.load_state_dict(best[2])
    model = model.to(torch.bfloat16)
    held_out_bf16 = evaluate(model, held_out_stream, args.seq_len, device)
    unigram = unigram_cross_entropy(train_stream, held_out_stream, tokenizer.get_vocab_size())
    return {
        "model": model, "params": params, "curve": curve, "evals": evals, "held_out_ce": held_out_bf16,
        "unigram_ce": unigram, "seconds": time.time() - started, "best_step": best[0],
    }


# ------------------------------------------------------------------------------- export


#: The chat template of every tiny model (the tokenizer has no chat tokens: turns are marked in plain
#: text, the prompt starts with the BOS and an assistant turn ends with the EOS, where generation stops).
CHAT_TEMPLATE = r"""{{- bos_token }}
{%- for message in messages %}
    {{- '### ' + message['role'] + '\n' }}
    {%- if message['content'] is string %}
        {{- message['content'] }}
    {%- elif message['content'] is defined %}
        {%- for part in message['content'] if part['type'] == 'text' %}
            {{- part['text'] }}
        {%- endfor %}
    {%- endif %}
    {%- if message['role'] == 'assistant' %}
        {{- eos_token }}
    {%- else %}
        {{- '\n\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '### assistant\n' }}
{%- endif %}
"""

#: ``tokenizer_config.json`` besides the template.
TOKENIZER_CONFIG = {'tokenizer_class': 'PreTrainedTokenizerFast', 'bos_token': '<|endoftext|>', 'eos_token': '<|endoftext|>',
                    'pad_token': '<|endoftext|>', 'clean_up_tokenization_spaces': False, 'model_max_length': 1024}

CARD = """# {name}

A tiny `{architecture}` trained from scratch to exercise Metrale's {family} family. It writes
text that reads like Python's documentation; it knows nothing else.

| | |
|---|---|
| parameters | {params:,} ({size_mb:.2f} MB of bf16 weights) |
| layers | {layers} |
| tokenizer | byte-level BPE, {vocab} tokens, trained on the same corpus |
| training | {steps} steps of {batch} x {seq_len} tokens, AdamW, lr {lr}, seed {seed}, float32, on {device}; weights of step {best_step} (lowest held-out loss of the evaluations every {eval_every} steps) |
| corpus | docstrings and `pydoc` reference topics of the Python {python} standard library (PSF License Agreement), {train_docs} documents, {train_tokens:,} tokens; SHA-256 `{digest}` |
| held-out split | {held_docs} documents ({held_tokens:,} tokens) from files that hash into a held-out bucket |
| software | torch {torch_version}, transformers {transformers_version}, tokenizers {tokenizers_version} |
| held-out perplexity (bf16 weights) | **{ppl:.2f}** |
| unigram baseline perplexity (add-one smoothed, same tokens) | {unigram:.2f} |

Its `tokenizer_config.json` holds a chat template. The tokenizer has no chat tokens, so the template marks
turns in plain text (`### user`, `### assistant`, ..., each on its own line), starts the prompt with the BOS
`<|endoftext|>` and ends each assistant turn with the same token, the EOS, where generation stops; the
model was never trained on conversations, so its replies still read like Python's documentation.

Reproduce: `python tools/checkpoints/train_tiny_models.py --models {name} --steps {steps} --batch {batch}
--seq-len {seq_len} --lr {lr} --vocab-size {vocab} --eval-every {eval_every} --seed {seed} --corpus-file CORPUS.json --device DEVICE`
(the loss curve is in `training.json`).
"""  # noqa: E501 (a table row of the card is one line)


def software_versions() -> dict:
    import tokenizers
    import torch
    import transformers

    return {
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "tokenizers_version": tokenizers.__version__,
    }


def export(name: str, result: dict, args, tokenizer, corpus: dict, digest: str, streams) -> Path:
    out = Path(args.out_dir) / name
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.safetensors"):
        stale.unlink()
    model = result["model"]
    model.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    if "mtp" in result:
        # The MTP layer beside the decoder's, as DeepSeek-V3 checkpoints hold it.
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(out / "model.safetensors"))
        tensors.update(mtp_tensors(result["mtp"], model.config))
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({**TOKENIZER_CONFIG, "chat_template": CHAT_TEMPLATE}, indent=2, ensure_ascii=False) + "\n")
    config = model.config
    size_mb = sum(p.numel() for p in model.parameters()) * 2 / 1e6
    family = {"tiny-dense": "dense", "tiny-mla": "MLA", "tiny-gdn": "GDN"}[name]
    (out / "README.md").write_text(CARD.format(
        name=name, architecture=config.architectures[0], family=family, params=result["params"], size_mb=size_mb,
        layers=config.num_hidden_layers, vocab=tokenizer.get_vocab_size(), steps=args.steps, batch=args.batch,
        device=args.device, best_step=result["best_step"], eval_every=args.eval_every,
        seq_len=args.seq_len, lr=args.lr, seed=args.seed, python=corpus["python"], train_docs=len(corpus["train"]),
        train_tokens=streams[0].numel(), digest=digest, held_docs=len(corpus["held_out"]),
        held_tokens=streams[1].numel(), ppl=math.exp(result["held_out_ce"]), unigram=math.exp(result["unigram_ce"]),
        **software_versions(),
    ))
    (out / "training.json").write_text(json.dumps({
        **software_versions(), "device": args.device, "seed": args.seed, "steps": args.steps, "corpus_sha256": digest,
        "loss_curve": result["curve"], "held_out_evals": result["evals"], "best_step": result["best_step"],
        "held_out_perplexity": math.exp(result["held_out_ce"]),
        "unigram_perplexity": math.exp(result["unigram_ce"]),
        **({"mtp_steps": args.mtp_steps, "mtp_loss_curve": result["mtp_curve"],
            "mtp_held_out_perplexity": math.exp(result["mtp_held_out_ce"]), "mtp_held_out_top1": result["mtp_top1"]}
           if "mtp" in result else {}),
    }, indent=None))
    return out


MTP_CARD = """
## Multi-token prediction

{where} is a multi-token-prediction layer trained on the frozen model above ({steps} steps of
{batch} x {seq_len} tokens, AdamW, lr {lr}, seed {seed}, on {device}; corpus SHA-256 `{digest}`): a
projection of the normed embedding of `t[i+1]` beside the normed final hidden state `h[i]`, one decoder layer,
a norm and the model's LM head, predicting `t[i+2]`. Held-out: perplexity {ppl:.2f}, top-1 accuracy {top1:.3f}.
Reproduce: `python tools/checkpoints/train_tiny_models.py --mtp-for metrale/models/{name} --mtp-steps {steps} --batch {batch}
--seq-len {seq_len} --lr {lr} --seed {seed} --corpus-file CORPUS.json --device DEVICE`.
"""


def mtp_prefix(config) -> str:
    """The prefix of every MTP tensor of a checkpoint of ``config``."""
    return "mtp." if config.model_type == "qwen3_next" else f"model.layers.{config.num_hidden_layers}."


def add_mtp(folder: Path, args) -> None:
    """Train an MTP module for the DeepSeek-V3 or Qwen3-Next checkpoint in ``folder`` (its weights
    frozen, its tokenizer) and write it into the checkpoint, its record and its card (replacing an
    earlier one)."""
    import torch
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    corpus = limited(load_corpus(args.corpus_file), args.max_docs)
    digest = corpus_digest(corpus)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    streams = (token_stream(tokenizer, corpus["train"]), token_stream(tokenizer, corpus["held_out"]))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(args.device)
    result = train_mtp(model, args, *streams)
    prefix = mtp_prefix(model.config)
    tensors = {name: value for name, value in load_file(str(folder / "model.safetensors")).items()
               if not name.startswith(prefix)}
    tensors.update(mtp_tensors(result["mtp"], model.config))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    record = json.loads((folder / "training.json").read_text())
    record.update({"mtp_steps": args.mtp_steps, "mtp_device": args.device, "mtp_seed": args.seed,
                   "mtp_corpus_sha256": digest, "mtp_loss_curve": result["mtp_curve"],
                   "mtp_held_out_perplexity": math.exp(result["mtp_held_out_ce"]),
                   "mtp_held_out_top1": result["mtp_top1"]})
    (folder / "training.json").write_text(json.dumps(record, indent=None))
    card = (folder / "README.md").read_text().split("\n## Multi-token prediction\n")[0].rstrip("\n") + "\n"
    (folder / "README.md").write_text(card + MTP_CARD.format(
        where=f"`{prefix}*`", steps=args.mtp_steps, batch=args.batch, seq_len=args.seq_len, lr=args.lr,
        seed=args.seed, device=args.device, digest=digest, ppl=math.exp(result["mtp_held_out_ce"]),
        top1=result["mtp_top1"], name=folder.name))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--out-dir", default=str(Path(__file__).resolve().parents[2] / "metrale" / "models"))
    parser.add_argument("--corpus-file", type=Path, default=None, help="read (or write) the extracted corpus here")
    parser.add_argument("--vocab-size", type=int, default=3072)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-docs", type=int, default=None, help="train on the first N documents only (for tests)")
    parser.add_argument("--mtp-steps", type=int, default=0,
                        help="tiny-mla, tiny-gdn: then train a multi-token-prediction module on the frozen model for N "
                             "steps")
    parser.add_argument("--mtp-for", type=Path, default=None,
                        help="only train an MTP module (--mtp-steps) for this DeepSeek-V3 or Qwen3-Next checkpoint "
                             "folder and add it")
    args = parser.parse_args()

    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    if args.mtp_for is not None:
        if not args.mtp_steps:
            raise SystemExit("--mtp-for needs --mtp-steps")
        add_mtp(args.mtp_for, args)
        return
    corpus = limited(load_corpus(args.corpus_file), args.max_docs)
    digest = corpus_digest(corpus)
    tokenizer = train_tokenizer(corpus["train"], args.vocab_size)
    streams = (token_stream(tokenizer, corpus["train"]), token_stream(tokenizer, corpus["held_out"]))
    print(f"corpus {digest[:12]}: {streams[0].numel():,} training tokens, {streams[1].numel():,} held out", flush=True)
    for name in args.models:
        result = train(name, args, tokenizer, streams[0], streams[1], corpus, digest)
        if args.mtp_steps and name in ("tiny-mla", "tiny-gdn"):
            result.update(train_mtp(result["model"], args, streams[0], streams[1]))
            result["model"] = result["model"].to(torch.bfloat16)
        out = export(name, result, args, tokenizer, corpus, digest, streams)
        print(f"{name}: held-out perplexity {math.exp(result['held_out_ce']):.2f} "
              f"(unigram {math.exp(result['unigram_ce']):.2f}) -> {out}", flush=True)


if __name__ == "__main__":
    main()
