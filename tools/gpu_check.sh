#!/usr/bin/env bash
# Runs the GPU test suite and the benchmark on a CUDA machine whose Python already has CuPy,
# numba-cuda, torch and transformers. Wheels in .whl/ (numpy < 2.5 for numba-cuda, and
# nvmath-python) are installed into /tmp/site first when present. Runs in the repository root
# whatever the caller's directory (OUTDIR is taken relative to the caller's).
#   tools/gpu_check.sh [OUTDIR] [bench arguments...]
set -uo pipefail
out=${1:-/tmp/metrale-gpu}; shift || true
mkdir -p "$out" && out=$(cd "$out" && pwd) || exit 1
cd "$(dirname "$0")/.." || exit 1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export NUMBA_CUDA_ARRAY_INTERFACE_SYNC=0 PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/numba-cache}
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"
python3 -c "import numpy, numba, cupy, torch, transformers; print('numpy', numpy.__version__, 'numba', numba.__version__, 'cupy', cupy.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$out/device.txt"
# Several workers share the GPU (pytest-xdist; PYTEST_WORKERS=0 runs them in one process).
workers=${PYTEST_WORKERS:-4}
parallel=(); [ "$workers" != 0 ] && parallel=(-n "$workers")
timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -m gpu -q -rA -p no:cacheprovider "${parallel[@]}" tests >"$out/pytest-gpu.log" 2>&1
echo "pytest -m gpu exit $?"; grep -E "passed|failed|error" "$out/pytest-gpu.log" | tail -3
if [ "${SKIP_BENCH:-0}" != 1 ]; then
    timeout "${BENCH_TIMEOUT:-400}" metrale bench --output "$out/bench.json" "$@" >"$out/bench.log" 2>&1
    echo "bench exit $?"; tail -30 "$out/bench.log"
fi
