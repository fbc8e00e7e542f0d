#!/usr/bin/env bash
# One call on a lent GPU: the CUDA tests, then the engine and kernel benchmarks.
# Usage (device tool): bash benchmarks/gpu_check.sh; everything it writes lands in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
[ -e sigmafast/kernels ] || ln -s ../kernels sigmafast/kernels  # the installed package maps it there
export PYTHONPATH=$PWD TRITON_INTERPRET=0
export TRITON_CACHE_DIR=$(mktemp -d) SIGMAFAST_CACHE=$(mktemp -d)
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,power.draw --format=csv | tee "$OUT/gpu.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"

run() {  # name, limit in seconds, command...
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name: rc=$? in $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
    tail -n 25 "$OUT/$name.log"
}
run tests "${GPU_TESTS_LIMIT:-90}" python -m pytest -m gpu tests/ -q -p no:cacheprovider -rs
run engine "${GPU_ENGINE_LIMIT:-270}" python -m pytest benchmarks/bench_engine.py --benchmark-only -q \
    -p no:cacheprovider --benchmark-json="$OUT/engine.json" --benchmark-columns=median,rounds -k "${GPU_ENGINE_K:-first_call or engine or gpt2}"
if [ "${GPU_KERNELS:-1}" = 1 ]; then
    run kernels "${GPU_KERNELS_LIMIT:-60}" python -m pytest benchmarks/bench_kernels.py --benchmark-only -q \
        -p no:cacheprovider --benchmark-json="$OUT/kernels.json" --benchmark-columns=median,rounds
fi
cat "$OUT/summary.txt"
