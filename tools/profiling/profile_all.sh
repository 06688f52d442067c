#!/usr/bin/env bash
# GPU tests, then tools/profiling/profile_decode.py for each "shape:batch" given (default: both Llama
# shapes at batch 1 and 32). Logs under OUTDIR (relative to the caller's directory); runs in the
# repository root.
#   tools/profiling/profile_all.sh OUTDIR [shape:batch ...]
set -uo pipefail
out=$1; shift
mkdir -p "$out" && out=$(cd "$out" && pwd) || exit 1
cd "$(dirname "$0")/../.." || exit 1
SKIP_BENCH=1 bash tools/gpu_check.sh "$out"
export PYTHONPATH=/tmp/site NUMBA_CUDA_ARRAY_INTERFACE_SYNC=0 PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/numba-cache}
for case in "${@:-llama-1b:1 llama-1b:32 llama-8b:1 llama-8b:32}"; do
    for item in $case; do
        shape=${item%%:*}; batch=${item##*:}
        timeout "${PROFILE_TIMEOUT:-120}" python3 tools/profiling/profile_decode.py --shape "$shape" --batch "$batch" \
            >"$out/profile-$shape-b$batch.log" 2>&1
        grep -v Warning "$out/profile-$shape-b$batch.log" | grep -v "warn(" | tail -40
    done
done
