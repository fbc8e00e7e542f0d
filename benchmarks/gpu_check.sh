#!/usr/bin/env bash
# One call on a lent GPU: the CUDA tests, the fused step kernels' and top-k tests compiled, the engine and kernel
# benchmarks, the vocabulary kernels' tests compiled (persistent streams at the card's occupancy), a step profile.
# Usage (device tool): bash benchmarks/gpu_check.sh; logs and JSON land in $OUT/gpu_check.tgz (rebuilt after
# each part; summary.txt beside it). Each part has a time limit (seconds; then SIGINT, so that pytest still
# prints its failures and writes its JSON, and SIGKILL 15 s later) and can be narrowed: GPU_<PART>_LIMIT,
# GPU_ENGINE_K / GPU_KERNELS_K (pytest -k),
# GPU_PARTS (the parts to run, in order). The default parts' limits add up to 1030 s, more than one device-tool
# call's 600, but they are caps (at the fourth lend: engine 74 s, kernels 33 s, tests 34 s; the compiled kernel
# tests of vocab and fused ran past 70 and 60 s), so the timings come first; in one call the engine part
# times sigmafast alone (the issue 9 targets); "anchors" (HF transformers and the compiled
# static-cache decoder, measured at the first lend) and "inductor" (Engine(compile_steps="inductor")) are extra
# parts for a second call; engine-ar and engine-burst split the engine part in two, each with its own JSON;
# "topk" runs the top-k tests compiled (also in "fused"), "sweep" times the vocabulary kernels' tilings,
# "small" times the levers of the small burst target in three runs, each with its own limit and rc: both
# scorings from hidden states, the small model's attention at forced KV splits and the residual sample's three
# layouts, split-V streams, one program per tile and by rows (small-kernels); burst small
# and gpt2 with both scorings, the timed one (auto), programmatic dependent launch (Engine(pdl=True)) and the
# fused GELU (small-engine); small profiles with auto scoring, PDL and the fused GELU (small-profile). With
# GPU_PARTS="small sweep tests vocab" the caps add up to 580 s: pass the device tool timeout_s=590. Each part's
# limit is also cut to what is left before GPU_DEADLINE_S (default 570 s from the start, less 20 s for the SIGKILL
# grace and the bundling), and a part with under 10 s left is skipped: set it under the call's timeout_s.
# pytest-benchmark writes its JSON only when a session ends, but cases.jsonl (SIGMAFAST_BENCH_LOG) gets
# each case as it finishes, so a part cut off by its limit loses only the case it was in. -k also matches the
# module name, so select by test function (test_engine, test_hf, test_anchor, test_first_call) and parameter
# ids, never "engine". The "train" part times `scripts/train.py --task owt` at GPT-2 size (tokens/s and MFU,
# eager and --compile) on a GPT-2 BPE token file that cannot be downloaded there: prepare it here with
#   TIKTOKEN_CACHE_DIR=../shared/tiktoken python scripts/prepare_owt.py --from-text \
#       ../shared/data/tinyshakespeare.txt --data-dir data/gpucheck/owt
# and pass carry=["data/gpucheck"] to the device tool (0.7 MB; data/ is git-ignored).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
LOGS=$(mktemp -d)  # every log and JSON, bundled into $OUT after each part: the device tool returns few files
bundle() {
    tar -czf "$OUT/gpu_check.tgz.part" -C "$LOGS" . && mv "$OUT/gpu_check.tgz.part" "$OUT/gpu_check.tgz"
    cp "$LOGS/summary.txt" "$OUT/" 2>/dev/null
    return 0
}
[ -e sigmafast/kernels ] || ln -s ../kernels sigmafast/kernels  # the installed package maps it there
export PYTHONPATH=$PWD TRITON_INTERPRET=0 PYTEST_ADDOPTS="-p no:xdist"  # one process on the one GPU
export TRITON_CACHE_DIR=$(mktemp -d) SIGMAFAST_CACHE=$(mktemp -d) SIGMAFAST_BENCH_LOG=$LOGS/cases.jsonl
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,power.draw --format=csv | tee "$LOGS/gpu.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$LOGS/gpu.txt"

DEADLINE=${GPU_DEADLINE_S:-570}  # seconds from the start: keep it under the device tool's timeout_s
run() {  # name, limit in seconds (cut to what is left before DEADLINE), command...
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS left=$((DEADLINE - SECONDS - 20))  # 20 s: the SIGKILL grace and the bundling
    if [ "$left" -lt 10 ]; then
        echo "== $name: skipped, $((DEADLINE - SECONDS)) s left before GPU_DEADLINE_S" | tee -a "$LOGS/summary.txt"
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    timeout -s INT -k 15 "$limit" "$@" > "$LOGS/$name.log" 2>&1
    echo "== $name: rc=$? in $((SECONDS - t0)) s" | tee -a "$LOGS/summary.txt"
    tail -n "${GPU_TAIL:-12}" "$LOGS/$name.log"
    bundle
}
BENCH=(--benchmark-only -q -p no:cacheprovider --benchmark-columns=median,rounds)
for part in ${GPU_PARTS:-engine kernels tests profile vocab fused train}; do  # the issues' timings first
    case $part in
    tests) run tests "${GPU_TESTS_LIMIT:-100}" python -m pytest -m gpu tests/ -q -p no:cacheprovider -rs \
        --durations=15 ;;
    fused) run fused "${GPU_FUSED_LIMIT:-120}" python -m pytest tests/test_kernels_commit.py \
        tests/test_kernels_layer_norm.py tests/test_kernels_linear_norm.py tests/test_kernels_decide.py \
        tests/test_kernels_embed.py tests/test_kernels_flags.py tests/test_kernels_along.py tests/test_kernels_slots.py \
        tests/test_kernels_rotary.py tests/test_kernels_lossless.py \
        tests/test_kernels_row_vectors.py tests/test_kernels_topk.py tests/test_kernels_plan.py \
        -q -p no:cacheprovider -rs --durations=15 ;;
    vocab) run vocab "${GPU_VOCAB_LIMIT:-100}" python -m pytest tests/test_kernels_residual_rows.py \
        tests/test_kernels_vocab.py tests/test_kernels_sampling.py -q -p no:cacheprovider -rs --durations=15 ;;
    topk) run topk "${GPU_TOPK_LIMIT:-60}" python -m pytest tests/test_kernels_topk.py -q -p no:cacheprovider -rs ;;
    small) run small-kernels "${GPU_SMALL_KERNELS_LIMIT:-60}" python -m pytest benchmarks/bench_kernels.py \
        "${BENCH[@]}" --benchmark-json="$LOGS/small.json" \
        -k "test_acceptance_from_hidden or test_small_model_attention or (test_sampling and residual_sample and triton)"
        run small-engine "${GPU_SMALL_LIMIT:-140}" python -m pytest benchmarks/bench_engine.py "${BENCH[@]}" \
            --benchmark-json="$LOGS/small_engine.json" \
            -k "test_engine and B1 and not rope and not tiny and (burst-small or burst-gpt2 or -scoring- or -pdl- \
                or -gelu-)"
        run small-profile "${GPU_SMALL_PROFILE_LIMIT:-80}" bash -c "rc=0; for flag in '--scoring auto' --pdl \
            --fused-gelu; do python benchmarks/profile_steps.py --shape small --batch 1 \$flag || rc=\$?; done; \
            exit \$rc" ;;
    sweep) run sweep "${GPU_SWEEP_LIMIT:-100}" python benchmarks/sweep_vocab.py --json "$LOGS/sweep.json" ;;
    engine) run engine "${GPU_ENGINE_LIMIT:-240}" python -m pytest benchmarks/bench_engine.py "${BENCH[@]}" \
        --benchmark-json="$LOGS/engine.json" -k "${GPU_ENGINE_K:-test_first_call or (test_engine and not inductor and not pdl)}" ;;
    anchors) run anchors "${GPU_ANCHORS_LIMIT:-300}" python -m pytest benchmarks/bench_engine.py "${BENCH[@]}" \
        --benchmark-json="$LOGS/anchors.json" -k "test_hf or test_anchor" ;;
    engine-ar) run engine-ar "${GPU_ENGINE_LIMIT:-270}" python -m pytest benchmarks/bench_engine.py "${BENCH[@]}" \
        --benchmark-json="$LOGS/engine_ar.json" -k "test_first_call or (test_engine and ar- and not inductor)" ;;
    engine-burst) run engine-burst "${GPU_ENGINE_LIMIT:-270}" python -m pytest benchmarks/bench_engine.py \
        "${BENCH[@]}" --benchmark-json="$LOGS/engine_burst.json" -k "test_engine and burst- and not inductor" ;;
    kernels) run kernels "${GPU_KERNELS_LIMIT:-150}" python -m pytest benchmarks/bench_kernels.py "${BENCH[@]}" \
        --benchmark-json="$LOGS/kernels.json" -k "${GPU_KERNELS_K:-test_}" ;;
    profile) run profile "${GPU_PROFILE_LIMIT:-120}" bash -c "python benchmarks/profile_steps.py --shape gpt2 --batch 1 \
        && python benchmarks/profile_steps.py --shape small --batch 1 \
        && python benchmarks/profile_steps.py --shape gpt2 --batch 1 --rule lossless" ;;
    train) if [ -f data/gpucheck/owt/train.bin ]; then  # carried: see the header
        run train "${GPU_TRAIN_LIMIT:-240}" bash -c "for c in --no-compile --compile; do python scripts/train.py \
            --task owt --data-dir data/gpucheck/owt --preset gpt2 --max-iters 40 --batch-size 16 --grad-accum 1 \
            --eval-interval 1000 --eval-iters 2 --log-interval 10 --out-dir \$(mktemp -d) \$c \
            || exit 1; done"
    else echo "== train: skipped, no data/gpucheck/owt (prepare it and carry data/gpucheck)" | tee -a "$LOGS/summary.txt"
    fi ;;
    inductor) run inductor "${GPU_INDUCTOR_LIMIT:-240}" python -m pytest benchmarks/bench_engine.py "${BENCH[@]}" \
        --benchmark-json="$LOGS/inductor.json" -k "${GPU_INDUCTOR_K:-test_engine and inductor and gpt2}" ;;
    esac
done
python benchmarks/gpu_summary.py "$LOGS"/cases.jsonl > "$LOGS/cases.txt" 2>&1
bundle
cat "$LOGS/summary.txt" "$LOGS/cases.txt"
