"""The vendored real ``config.json`` files (tests/data/hub_configs) at their real widths: each cut to
the fewest layers that still hold every layer kind, nothing else changed (``quantization_config``
dropped: the random weights are float32), given random weights by transformers and run on the
CPU by metrale and by transformers, printing the largest relative error of the logits.

Not a CI test: a cut model at real widths takes seconds to minutes and gigabytes of memory. A
config whose cut model has more than ``--max-params`` parameters is skipped, and the line says
so: the check holds one float32 copy at a time (transformers' to write the weights, then to
compute the reference, then metrale's), and the default keeps two copies within 23 GB.

The prompt is ``--prompt-length`` tokens, or a window and eight tokens more where a sliding
window of at most ``--window-limit`` tokens is in use. LongRoPE models are served with
``max_model_len`` at their pretraining context and a short prompt, so their short factors are
the ones checked (their long factors need a prompt past 4096 tokens).

    python3 tools/checkpoints/check_hub_configs.py --max-params 2.5e9 | tee /tmp/hub-configs-check.txt
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "loading"))

from test_hub_configs import (  # noqa: E402  (the helpers of the CI test, after the path line)
    ZERO_CENTRED_NORMS,
    cut_layers,
    is_longrope,
    prompt,
    served_configs,
    uses_sliding_window,
    without_quantization,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-params", type=float, default=2.5e9,
                        help="skip a config whose cut model has more parameters (default 2.5e9)")
    parser.add_argument("--prompt-length", type=int, default=24, help="tokens of the prompt (default 24)")
    parser.add_argument("--window-limit", type=int, default=1024,
                        help="a sliding window up to this many tokens is exceeded by the prompt (default 1024)")
    parser.add_argument("--only", nargs="*", default=None, help="check only these cases (file names without .json)")
    return parser.parse_args(argv)


def hf_config_of(config: dict[str, Any]) -> Any:
    import transformers

    fields = {key: value for key, value in config.items() if key not in ("architectures", "model_type")}
    return transformers.AutoConfig.for_model(config["model_type"], **fields)


def parameter_count(config: dict[str, Any]) -> int:
    """Parameters of the transformers model of ``config``, counted without allocating them."""
    import torch
    import transformers

    with torch.device("meta"):
        model = getattr(transformers, config["architectures"][0])(hf_config_of(config))
    return sum(parameter.numel() for parameter in model.parameters())


def prompt_length(config: dict[str, Any], args: argparse.Namespace) -> int:
    window = config.get("sliding_window")
    if uses_sliding_window(config) and window is not None and window <= args.window_limit:
        return window + 8
    return args.prompt_length


def write_checkpoint(config: dict[str, Any], folder: Path, seed: int) -> None:
    """Random weights by :func:`metrale.testing.hf.build_hf_checkpoint`, then ``config`` itself as
    ``config.json`` (the Hub file's spelling, read by both sides)."""
    import transformers

    from metrale.testing.hf import build_hf_checkpoint

    model_class = getattr(transformers, config["architectures"][0])
    build_hf_checkpoint(model_class, hf_config_of(config), folder, seed=seed,
                        zero_centred_norms=config["model_type"] in ZERO_CENTRED_NORMS)
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def transformers_logits(folder: Path, token_ids: list[int]) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([token_ids], dtype=torch.long)).logits[0].float().numpy()
    del model
    gc.collect()
    return logits


def metrale_logits(folder: Path, token_ids: list[int], max_model_len: int) -> Any:
    from metrale import LLM

    with LLM(str(folder), device="cpu", show_progress=False, max_model_len=max_model_len) as llm:
        logits = llm.score(token_ids)
    gc.collect()
    return logits


def check(name: str, config: dict[str, Any], args: argparse.Namespace) -> str:
    from metrale.testing import max_relative_error

    cut = without_quantization(cut_layers(config))
    params = parameter_count(cut)
    head = f"{name:40s} layers {config['num_hidden_layers']:>2} -> {cut['num_hidden_layers']:<2} {params / 1e9:6.2f}B params"
    if params > args.max_params:
        return f"{head}  skipped: more than --max-params {args.max_params:.3g}"
    length = prompt_length(cut, args)
    context = cut["original_max_position_embeddings"] if is_longrope(cut) else max(length, 256)
    token_ids = prompt(length, min(cut.get("vocab_size", 256), 32000), 1)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hub-config-") as folder:
        write_checkpoint(cut, Path(folder), seed=0)
        gc.collect()
        reference = transformers_logits(Path(folder), token_ids)
        ours = metrale_logits(Path(folder), token_ids, context)
    error = max_relative_error(ours, reference)
    return f"{head}  prompt {length:>4}  relative error {error:.2e}  ({time.perf_counter() - started:.0f} s)"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"real config.json files, layer count cut, random float32 weights, CPU; max params {args.max_params:.3g}",
          flush=True)
    for name, config in served_configs():
        if args.only and name not in args.only and name.split(":")[0] not in args.only:
            continue
        try:
            line = check(name, config, args)
        except Exception as error:  # a failure is a result to print, the others still run
            line = f"{name:40s} FAILED: {type(error).__name__}: {error}"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
