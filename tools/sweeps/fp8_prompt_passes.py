"""The passes around an FP8 prompt product on the Llama-8B shapes, each beside what it replaced:

* the scaling pass of a float32 product (``scale_product``: each row times its input scale, each
  column its weight scale) against the same arithmetic as a CuPy elementwise kernel (an index
  divided and taken modulo the width for every element);
* the down projection's FP8 input rows written from the bf16 gate/up product in one pass
  (``silu_and_mul_fp8_rows``) against ``silu_and_mul_words`` then ``quantize_rows_fp8``;
* the q/k/v and gate/up products' FP8 input rows written by the norm (``rmsnorm_fp8_rows``)
  against ``rmsnorm_residual_words`` then ``quantize_rows_fp8``;
* a float32 FP8 product of the q/k/v, o and down shapes two ways: cuBLASLt's float32 product, then
  the scaling pass (what the prompt path serves), against its bf16 product with the scales in the
  epilogue, then widened to float32 (one more rounding, to bf16).

Each is recorded 20 times into a CUDA graph and the graph replayed; microseconds a launch and the
bytes read and written per microsecond are printed. Run from the repository root::

    python3 tools/sweeps/fp8_prompt_passes.py [--rows 2048,8192]
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

#: Widths of the float32 products scaled (q/k/v, o and down of the 8B shape).
PRODUCT_WIDTHS = (6144, 4096)
#: The 8B shape's intermediate size (the gate/up product is twice as wide).
INTERMEDIATE = 14336
#: The 8B shape's hidden size (the norms' rows).
HIDDEN = 4096


def elementwise_scaling() -> Any:
    """The scaling pass as an elementwise kernel over the product's elements."""
    import cupy as cp

    return cp.ElementwiseKernel("raw float32 row_scales, raw float32 column_scales, int64 columns", "float32 out",
                                "out = out * row_scales[i / columns] * column_scales[i % columns]",
                                "elementwise_scale_product")


def down_input_weight(width: int, rng: np.random.Generator) -> Any:
    """A host FP8 weight ``[16, width]`` with per-token inputs: the codes' product is not timed,
    only the input rows written for it."""
    from metrale.kernels.quantized import quantize_fp8_per_channel

    return quantize_fp8_per_channel(rng.normal(size=(16, width)).astype(np.float32) * 0.02, "fp8_token")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="2048,8192", help="prompt rows (default: 2048,8192)")
    args = parser.parse_args()

    import cupy as cp
    from quantized_gemv_sweep import timed

    from metrale.backends.cuda import CudaBackend
    from metrale.kernels import activation
    from metrale.kernels import quantized_gemv as qg
    from metrale.kernels.bf16 import float32_to_bf16

    backend = CudaBackend()
    rng = np.random.default_rng(0)
    elementwise = elementwise_scaling()
    weight = backend.quantized_weight(down_input_weight(INTERMEDIATE, rng))
    backend.stream.synchronize()
    print(f"# {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}", flush=True)
    for rows in (int(r) for r in args.rows.split(",")):
        for width in PRODUCT_WIDTHS:
            outs = [cp.random.standard_normal((rows, width), dtype=cp.float32) for _ in range(2)]
            row_scales = cp.random.uniform(0.1, 1, rows, dtype=cp.float32)
            column_scales = cp.random.uniform(0.1, 1, width, dtype=cp.float32)

            def former(s: Any, c: int, o: list = outs, r: Any = row_scales, k: Any = column_scales, w: int = width) -> None:
                with s:
                    elementwise(r, k, np.int64(w), o[c])

            def kernel(s: Any, c: int, o: list = outs, r: Any = row_scales, k: Any = column_scales) -> None:
                qg.scale_product(o[c], r, k, s)

            before, now = timed(former, 2), timed(kernel, 2)
            moved = rows * width * 8
            print(f"scale_product {rows} x {width}: elementwise {before:7.1f} us, kernel {now:7.1f} us "
                  f"({moved / now / 1e3:5.0f} GB/s)", flush=True)
        gate_up = [cp.asarray(float32_to_bf16(rng.normal(size=(rows, 2 * INTERMEDIATE)).astype(np.float32)))
                   for _ in range(2)]
        act = cp.empty((rows, INTERMEDIATE), np.uint16)
        codes, scales = cp.empty((rows, INTERMEDIATE), np.uint8), cp.empty(rows, np.float32)

        def unfused(s: Any, c: int) -> None:
            activation.silu_and_mul_words(gate_up[c], act, s)
            qg.quantize_rows_fp8(act, weight, codes, scales, s)

        def fused(s: Any, c: int) -> None:
            qg.silu_and_mul_fp8_rows(gate_up[c], weight, codes, scales, s)

        before, now = timed(unfused, 2), timed(fused, 2)
        moved = rows * INTERMEDIATE * 5  # 4 bytes of gate/up read and a code written a value
        print(f"down input rows {rows} x {INTERMEDIATE}: silu_and_mul then quantize_rows_fp8 {before:7.1f} us, "
              f"silu_and_mul_fp8_rows {now:7.1f} us ({moved / now / 1e3:5.0f} GB/s)", flush=True)
        norm_rows(rows, backend, rng, timed)
        float32_products(rows, rng, timed)
    backend.close()


def norm_rows(rows: int, backend: Any, rng: np.random.Generator, timed: Any) -> None:
    """The q/k/v and gate/up products' FP8 input rows written by the norm (``rmsnorm_fp8_rows``)
    against ``rmsnorm_residual_words`` then ``quantize_rows_fp8`` of its bf16 rows."""
    import cupy as cp

    from metrale.kernels import quantized_gemv as qg
    from metrale.kernels import rmsnorm

    weight = backend.quantized_weight(down_input_weight(HIDDEN, rng))
    gains = backend.weight(rng.uniform(0.5, 1.5, size=HIDDEN).astype(np.float32))
    backend.stream.synchronize()
    xs = [cp.random.standard_normal((rows, HIDDEN), dtype=cp.float32) for _ in range(2)]
    residual = cp.random.standard_normal((rows, HIDDEN), dtype=cp.float32)
    normed = cp.empty((rows, HIDDEN), np.uint16)
    codes, scales = cp.empty((rows, HIDDEN), np.uint8), cp.empty(rows, np.float32)

    def unfused(s: Any, c: int) -> None:
        rmsnorm.rmsnorm_residual_words(xs[c], residual, gains, 1e-5, 0.0, True, normed, s)
        qg.quantize_rows_fp8(normed, weight, codes, scales, s)

    def fused(s: Any, c: int) -> None:
        qg.rmsnorm_fp8_rows(xs[c], residual, gains, 1e-5, 0.0, True, weight, codes, scales, s)

    before, now = timed(unfused, 2), timed(fused, 2)
    moved = rows * HIDDEN * 13  # x and the residual read, the sum written, a code written a value
    print(f"norm input rows {rows} x {HIDDEN}: rmsnorm_residual_words then quantize_rows_fp8 {before:7.1f} us, "
          f"rmsnorm_fp8_rows {now:7.1f} us ({moved / now / 1e3:5.0f} GB/s)", flush=True)


#: (K, N) of the float32 FP8 products of the 8B shape's prompt (q/k/v, o, down).
FLOAT32_PRODUCTS = [(4096, 6144), (4096, 4096), (14336, 4096)]


def float32_products(rows: int, rng: np.random.Generator, timed: Any) -> None:
    """The float32 product of FP8 codes scaled after it against the bf16 product scaled in its
    epilogue and widened (the rows' quantization, the same in both, not timed)."""
    import cupy as cp

    from metrale.kernels import activation
    from metrale.kernels import quantized_gemv as qg
    from metrale.kernels.linear import CublasLtGemm

    for inner, columns in FLOAT32_PRODUCTS:
        codes = cp.asarray(rng.integers(0, 0x7E, size=(rows, inner), dtype=np.uint8))
        weights = [cp.asarray(rng.integers(0, 0x7E, size=(columns, inner), dtype=np.uint8)) for _ in range(2)]
        row_scales = cp.random.uniform(0.1, 1, rows, dtype=cp.float32)
        column_scales = cp.random.uniform(0.1, 1, columns, dtype=cp.float32)
        out = cp.empty((rows, columns), np.float32)
        out_bf16 = cp.empty((rows, columns), np.uint16)
        gemms: dict[Any, Any] = {}

        def gemm(s: Any) -> Any:
            if s not in gemms:
                gemms[s] = CublasLtGemm(s)
            return gemms[s]

        def scaled_after(s: Any, c: int) -> None:
            gemm(s).fp8(codes, weights[c], out)
            qg.scale_product(out, row_scales, column_scales, s)

        def epilogue_widened(s: Any, c: int) -> None:
            gemm(s).fp8(codes, weights[c], out_bf16, row_scales=row_scales, column_scales=column_scales)
            activation.to_float32(out_bf16, out, s)

        try:
            before, now = timed(scaled_after, 2), timed(epilogue_widened, 2)
        except Exception as error:  # no FP8 (or no epilogue-scaled) algorithm on this GPU
            print(f"float32 product {rows} x {inner} x {columns}: {type(error).__name__}: {error}", flush=True)
            continue
        print(f"float32 product {rows} x {inner} x {columns}: scaled after {before:7.1f} us, bf16 epilogue then "
              f"widened {now:7.1f} us", flush=True)


if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))  # quantized_gemv_sweep's timing
    main()
