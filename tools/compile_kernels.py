"""Compile every CUDA kernel to PTX for compute capability 9.0, without a GPU.

Type errors and unsupported constructs in a numba kernel only show when it compiles; the CUDA
simulator runs kernels as Python and never compiles them. This script compiles each kernel with
the argument types the launchers pass, using the CUDA toolkit's NVVM (no device, no driver).

    python tools/compile_kernels.py          # prints one line per kernel, exits 1 on a failure
"""

from __future__ import annotations

import os
import sys
import traceback
from types import SimpleNamespace

os.environ.pop("NUMBA_ENABLE_CUDASIM", None)

from numba import cuda, types  # noqa: E402
from numba.cuda import dispatcher  # noqa: E402

# Device functions ask the current device for its compute capability; answer for an H200.
dispatcher.get_current_device = lambda: SimpleNamespace(compute_capability=(9, 0))

f32, i32, i64, u16, u32, u64 = types.float32, types.int32, types.int64, types.uint16, types.uint32, types.uint64


def c(dtype, ndim):
    return types.Array(dtype, ndim, "C")


def kernels():
    from metrale.kernels import (
        activation,
        attention,
        attention_grouped,
        attention_latent,
        attention_prefill,
        attention_staged,
        gated,
        gated_delta,
        head_linear,
        layernorm,
        logits_process,
        moe,
        moe_clamped,
        qkv_rope,
        rmsnorm,
        token_mask,
    )

    attention_arguments = (
        c(f32, 3), c(u64, 2), c(u64, 2), i32, i32, c(i32, 2), c(i32, 1), c(i32, 1), f32, i32, c(f32, 4),
        c(f32, 3), c(f32, 3), c(u16, 2))
    return {
        "rmsnorm_residual": (rmsnorm.rmsnorm_residual_kernel, (c(f32, 2), c(f32, 2), c(u16, 1), f32, f32, i32, c(u16, 2))),
        "layernorm_residual": (layernorm.layernorm_residual_kernel, (
            c(f32, 2), c(f32, 2), c(u16, 1), c(f32, 1), i32, f32, i32, c(u16, 2))),
        "silu_and_mul": (activation.silu_and_mul_kernel, (c(f32, 2), c(u16, 2))),
        "silu_and_mul_bf16": (activation.silu_and_mul_bf16_kernel, (c(u16, 2), c(u16, 2))),
        "gelu": (activation.gelu_kernel, (c(f32, 2), i32, c(u16, 2))),
        "gelu_and_mul": (activation.gelu_and_mul_kernel, (c(f32, 2), i32, c(u16, 2))),
        "to_bf16": (activation.to_bf16_kernel, (c(f32, 1), c(u16, 1))),
        "qkv_rope_cache": (qkv_rope.qkv_rope_cache_kernel, (
            c(f32, 2), c(i32, 1), c(i32, 1), c(f32, 1), f32, c(u16, 1), c(u16, 1), f32, f32, i32, i32, i32, i32,
            c(f32, 3), c(u16, 4), c(u16, 4))),
        "paged_attention_split": (attention.paged_attention_split_kernel, (
            c(f32, 3), c(u16, 4), c(u16, 4), c(i32, 2), c(i32, 1), c(i32, 1), f32, i32, f32, c(f32, 1), i32, c(f32, 4),
            c(f32, 3), c(f32, 3))),
        "attention_combine": (attention.attention_combine_kernel, (c(f32, 4), c(f32, 3), c(f32, 3), c(u16, 2))),
        "paged_attention_grouped_d64": (attention_grouped.grouped_kernel(16), attention_arguments),
        "paged_attention_staged_d64": (attention_staged.staged_kernel(16), attention_arguments),
        "paged_attention_staged_d128": (attention_staged.staged_kernel(32), attention_arguments),
        "paged_attention_grouped_d128": (attention_grouped.grouped_kernel(32), attention_arguments),
        "latent_attention": (attention_latent.latent_attention_kernel, (
            c(f32, 3), c(u32, 3), c(u16, 3), c(f32, 2), i32, c(i32, 2), c(i32, 1), c(i32, 1), f32, i32, c(f32, 4),
            c(f32, 3), c(f32, 3))),
        "latent_cache_write": (attention_latent.latent_cache_write_kernel, (
            c(f32, 2), c(u16, 1), f32, c(i32, 1), c(f32, 1), f32, i32, c(i32, 1), c(u16, 3))),
        "grouped_combine": (attention_grouped.grouped_combine_kernel, (c(f32, 4), c(f32, 3), c(f32, 3), c(u16, 2))),
        "paged_attention_prefill": (attention_prefill.paged_attention_prefill_kernel, (
            c(f32, 3), c(u32, 4), c(u32, 4), c(i32, 2), c(i32, 1), c(i32, 1), c(i32, 2), f32, i32, f32, c(f32, 1), i32,
            c(u16, 2))),
        "gated_rmsnorm": (gated.gated_rmsnorm_kernel, (c(f32, 2), c(f32, 2), c(f32, 1), f32, c(u16, 2))),
        "sigmoid_gate": (gated.sigmoid_gate_kernel, (c(u16, 1), c(f32, 1), c(u16, 1))),
        "gdn_conv_update": (gated_delta.conv_update_kernel, (c(f32, 2), c(f32, 2), c(f32, 3), c(i32, 1), c(f32, 2))),
        "gdn_recurrent_step": (gated_delta.recurrent_step_kernel, (
            c(f32, 3), c(f32, 3), c(f32, 3), c(f32, 2), c(f32, 2), c(f32, 4), c(i32, 1), c(f32, 3))),
        "gdn_prompt_rule": (gated_delta.prompt_rule_kernel, (
            c(f32, 3), c(f32, 3), c(f32, 3), c(f32, 2), c(f32, 2), c(f32, 4), c(i32, 1), c(i32, 1), c(f32, 3))),
        "gdn_ungroup": (gated_delta.ungroup_kernel, (c(f32, 2), i32, i32, c(f32, 2), c(f32, 2))),
        "gdn_gates": (gated_delta.gates_kernel, (c(f32, 2), c(f32, 1), c(f32, 1), i32, c(f32, 2), c(f32, 2))),
        "gdn_split_heads": (gated_delta.split_heads_kernel, (c(f32, 2), f32, f32, c(f32, 3), c(f32, 3), c(f32, 2))),
        "gdn_conv_prompts": (gated_delta.conv_prompts_kernel, (
            c(f32, 2), c(f32, 2), c(f32, 3), c(i32, 1), c(i32, 1), c(f32, 2))),
        "gdn_conv_prompt_states": (gated_delta.conv_prompt_states_kernel, (c(f32, 2), c(f32, 3), c(i32, 1), c(i32, 1))),
        "gated_add": (gated.gated_add_kernel, (c(f32, 2), c(f32, 2), c(f32, 2), c(f32, 2))),
        "latent_query": (attention_latent.latent_query_kernel, (
            c(f32, 3), c(f32, 3), c(i32, 1), c(f32, 1), f32, i32, c(f32, 3))),
        "head_linear": (head_linear.head_linear_kernel, (c(u64, 2), c(u64, 2), c(f32, 3))),
        "moe_route": (moe.route_kernel, (
            c(f32, 2), c(f32, 1), i32, i32, i32, i32, types.boolean, f32, c(i32, 2), c(f32, 2))),
        "router_logits": (moe.router_logits_kernel, (c(u64, 2), c(f32, 2), c(f32, 2))),
        "moe_gate_up": (moe.moe_gate_up_kernel, (c(u64, 2), c(u64, 2), c(i32, 2), c(u16, 2))),
        "moe_down": (moe.moe_down_kernel, (c(u64, 2), c(u64, 2), c(i32, 2), c(f32, 2), c(f32, 2))),
        "moe_clamped_gate_up": (moe_clamped.clamped_gate_up_kernel, (
            c(u64, 2), c(u64, 2), c(f32, 1), types.boolean, c(i32, 2), f32, f32, c(f32, 2))),
        "moe_clamped_gate_up_mxfp4": (moe_clamped.clamped_gate_up_mxfp4_kernel, (
            c(f32, 2), c(u32, 2), c(f32, 2), c(f32, 1), types.boolean, c(i32, 2), f32, f32, c(f32, 2))),
        "moe_clamped_down": (moe_clamped.clamped_down_kernel, (
            c(f32, 2), c(u64, 2), c(f32, 1), types.boolean, c(i32, 2), c(f32, 2), c(f32, 2))),
        "moe_clamped_down_mxfp4": (moe_clamped.clamped_down_mxfp4_kernel, (
            c(f32, 2), c(u32, 2), c(f32, 2), c(f32, 1), types.boolean, c(i32, 2), c(f32, 2), c(f32, 2))),
        "logit_bias": (logits_process.logit_bias_kernel, (c(f32, 2), c(i32, 1), c(i32, 1), c(f32, 1))),
        "penalties": (logits_process.penalty_kernel, (c(f32, 2), c(i32, 1), c(i32, 2), c(f32, 1), c(f32, 1), c(f32, 1))),
        "count_tokens": (logits_process.count_tokens_kernel, (c(i32, 2), c(i32, 1), c(i32, 1))),
        "top_logprobs": (logits_process.top_logprobs_kernel, (
            c(f32, 2), c(i32, 1), c(i32, 1), c(i32, 2), c(f32, 2), c(i32, 1))),
        "apply_token_bitmask": (token_mask.apply_token_bitmask_kernel, (c(f32, 2), c(i32, 2), c(i32, 1))),
    }


def main() -> int:
    failures = 0
    for name, (kernel, signature) in kernels().items():
        try:
            ptx, _ = cuda.compile_ptx(kernel.py_func, signature, cc=(9, 0))
            print(f"ok      {name} ({len(ptx)} bytes of PTX)")
        except Exception:
            failures += 1
            print(f"FAILED  {name}\n{traceback.format_exc(limit=3)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
