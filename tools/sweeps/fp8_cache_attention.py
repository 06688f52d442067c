"""GPU time of the tensor-core decode attention over a bf16 cache and over an FP8 cache.

    python tools/sweeps/fp8_cache_attention.py [--cases 32x8192,8x4096,64x2048] [--parts] [--row-reads]

For each case (rows x context, every row at that context, blocks of 16 tokens shuffled) prints
the microseconds a launch of :func:`metrale.kernels.attention_decode_mma.decode_attention` takes
(20 launches after 3, CUDA events) and the cache bytes read per µs (FP8: the codes and a float32
scale per slot and KV head), with the launcher's split and stage counts. ``--parts`` also times
the FP8 kernel of the first case with parts of its source taken out -- the scales' copies, the
codes' copies, the codes' conversion, the probabilities' low part -- to show where a step's time
goes (those kernels compute wrong results; they are never served). ``--row-reads`` also times
plain reads of 512 MB as rows of 64 to 256 bytes at the strides a KV head's rows lie at in the
paged cache (8 heads a slot), against contiguous reads.
"""

from __future__ import annotations

import argparse

import numpy as np

#: Parts of the FP8 kernel's source --parts takes out: (name, [(text, replacement)]).
PARTS = [
    ("without the scales' copies", [
        ("            copy_4(shared_address(&raw_scales[(stage * 2 + half) * BLOCK_KEYS + key]), source, offset >= 0);",
         "")]),
    ("without the codes' copies", [
        ("            copy_16(shared_address(&raw[(half * BLOCK_KEYS + key) * RAW_STRIDE + chunk * 16]), source, "
         "offset >= 0);", "")]),
    ("without the code conversion", [
        ("                    e4m3x2_to_f16x2(codes[2 * half] & 0xffffu), e4m3x2_to_f16x2(codes[2 * half + 1] & 0xffffu),\n"
         "                    e4m3x2_to_f16x2(codes[2 * half] >> 16), e4m3x2_to_f16x2(codes[2 * half + 1] >> 16)};",
         "codes[2 * half], codes[2 * half + 1], codes[2 * half], codes[2 * half + 1]};"),
        ("{e4m3x2_to_f16x2(first & 0xffffu), e4m3x2_to_f16x2(first >> 16),\n"
         "                                             e4m3x2_to_f16x2(second & 0xffffu), e4m3x2_to_f16x2(second >> 16)};",
         "{first, first, second, second};")]),
    ("without the probabilities' low part", [
        ("                    MMA_16x8x16(acc[mt + half][nt], operand, low_weights[nt]);\n", "")]),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="32x8192,8x4096,64x2048", help="rows x context (comma-separated)")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--parts", action="store_true", help="the FP8 kernel of the first case with parts taken out")
    parser.add_argument("--row-reads", action="store_true", help="plain reads of rows at the cache's strides")
    args = parser.parse_args()

    import cupy as cp

    from metrale.kernels import attention_decode_mma as mma
    from metrale.kernels.kv_cache_fp8 import Fp8CacheArray

    def timed(launch, repeats: int = 20) -> float:
        stream = cp.cuda.get_current_stream()
        for _ in range(3):
            launch()
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        for _ in range(repeats):
            launch()
        end.record(stream)
        end.synchronize()
        return cp.cuda.get_elapsed_time(start, end) * 1000 / repeats

    heads, kv_heads, head_dim, block_size = args.heads, args.kv_heads, args.head_dim, 16
    cases = [tuple(int(n) for n in case.split("x")) for case in args.cases.split(",")]
    rng = np.random.default_rng(0)

    def setup(rows: int, context: int) -> dict:
        blocks = rows * -(-context // block_size) + 8
        tables = rng.permutation(blocks)[: rows * -(-context // block_size)].reshape(rows, -1).astype(np.int32)
        shape = (blocks, block_size, kv_heads, head_dim)

        def bf16_cache():
            return (cp.random.standard_normal(shape, dtype=cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)

        def fp8_cache():  # positive codes below the largest value, a scale of 0.01 each
            return Fp8CacheArray(cp.random.randint(0, 0x7E, shape, dtype=cp.uint8),
                                 cp.full(shape[:3], 0.01, cp.float32))

        return dict(q=cp.random.standard_normal((rows, heads, head_dim), dtype=cp.float32), tables=cp.asarray(tables),
                    seq_index=cp.arange(rows, dtype=cp.int32), positions=cp.full(rows, context - 1, dtype=cp.int32),
                    out=cp.empty((rows, heads * head_dim), cp.uint16), bf16=(bf16_cache(), bf16_cache()),
                    fp8=(fp8_cache(), fp8_cache()))

    def launcher(case: dict, rows: int, context: int, fp8: bool):
        splits = mma.device_split_count(rows, heads, kv_heads, head_dim, context, fp8=fp8)
        workspace = (cp.empty((rows, heads, splits, head_dim), cp.float32), cp.empty((rows, heads, splits), cp.float32),
                     cp.empty((rows, heads, splits), cp.float32))
        counters = cp.zeros(mma.counter_count(rows, heads, kv_heads), cp.int32)
        k_cache, v_cache = case["fp8" if fp8 else "bf16"]

        def launch():
            mma.decode_attention(case["q"], k_cache, v_cache, case["tables"], case["seq_index"], case["positions"],
                                 head_dim**-0.5, None, workspace, case["out"], counters=counters)

        stages = mma.launch_stages(rows, heads, kv_heads, head_dim, splits, case["tables"].shape[1] * block_size,
                                   mma.multiprocessor_count(), fp8)
        return launch, splits, stages

    for rows, context in cases:
        case = setup(rows, context)
        print(f"rows {rows:3} context {context:5}:")
        for fp8 in (False, True):
            launch, splits, stages = launcher(case, rows, context, fp8)
            micros = timed(launch)
            per_token = 2 * (head_dim + 4) if fp8 else 2 * head_dim * 2
            rate = rows * context * kv_heads * per_token / micros / 1e3
            print(f"   {'fp8' if fp8 else 'bf16':5} {micros:8.1f} us {rate:6.0f} GB/s (splits {splits}, stages {stages})")

    if args.parts:
        rows, context = cases[0]
        case = setup(rows, context)
        original = mma.KERNEL
        try:
            for name, edits in PARTS:
                source = original
                for text, replacement in edits:
                    if text not in source:
                        raise SystemExit(f"--parts: the kernel's source no longer has the text of {name!r}")
                    source = source.replace(text, replacement)
                mma.KERNEL = source
                mma._kernels.clear()
                launch, _, _ = launcher(case, rows, context, True)
                print(f"fp8 {rows} x {context} {name:36}: {timed(launch):8.1f} us")
        finally:
            mma.KERNEL = original
            mma._kernels.clear()

    if args.row_reads:
        row_reads(cp, timed)


#: Rows of R bytes read every S bytes, summed so the reads are kept.
ROW_READS = r"""
extern "C" __global__ void read_rows(const uint4* __restrict__ base, int row_words, long long stride_words,
                                     long long rows, unsigned* out) {
    unsigned acc = 0;
    const long long total = rows * row_words;
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < total; e += (long long)gridDim.x * blockDim.x) {
        const long long row = e / row_words;
        const int word = e % row_words;
        const uint4 v = __ldcs(base + row * stride_words + word);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) out[0] = acc;
}
"""


def row_reads(cp, timed) -> None:
    """GB/s of reading 512 MB as rows of R bytes every S bytes (a 2 GB buffer)."""
    kernel = cp.RawKernel(ROW_READS, "read_rows")
    buffer = cp.zeros(2 << 30, cp.uint8)
    out = cp.zeros(1, cp.uint32)
    for row_bytes, stride_bytes in [(128, 128), (128, 1024), (256, 2048), (256, 256), (64, 512)]:
        rows = min((512 << 20) // row_bytes, buffer.nbytes // stride_bytes)
        arguments = (buffer, cp.int32(row_bytes // 16), cp.int64(stride_bytes // 16), cp.int64(rows), out)
        millis = timed(lambda: kernel((132 * 16,), (256,), arguments), repeats=10) / 1000
        print(f"rows of {row_bytes:4} B every {stride_bytes:5} B: {rows * row_bytes / millis / 1e6:7.0f} GB/s")


if __name__ == "__main__":
    main()
