#!/usr/bin/env bash
# One device call that checks and tunes the engine on one NVIDIA GPU before the published benchmark
# (benchmarks/bench_engine.py), writing everything into $OUT:
#
#   1. the engine's GPU tests (pytest -m gpu; TESTS: kernels, pipelined rounds,
#      statistics, model, prefill by default)                                -> gpu_tests.log
#   2. the attention launch-configuration sweep (attention_sweep.py)          -> attn/attention_sweep.json, attention_env.sh
#   3. SMC-SD / AR end to end under kernel variants, with the sweep's best
#      attention settings exported (engine_variants.py --sections e2e)        -> variants/variants.json
#
#   OUT=/tmp/check bash benchmarks/engine_gpu_check.sh      # ~8 minutes on an H200
#
# Each step has its own time limit (TESTS_S, SWEEP_S, VARIANTS_S) so one slow step cannot take the
# others' time; the sweep's environment line is also printed last, for the benchmark that follows.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
T0=$(date +%s)
elapsed() { echo "[$(( $(date +%s) - T0 )) s]"; }

TESTS=${TESTS:-"tests/test_engine_kernels.py tests/test_engine_pipeline.py tests/test_engine_statistics.py
               tests/test_engine_model.py tests/test_engine_prefill.py"}
# shellcheck disable=SC2086
timeout "${TESTS_S:-210}" python -m pytest -q -m gpu $TESTS -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
echo "== tests rc=$? $(elapsed)"; tail -n 15 "$OUT/gpu_tests.log"

timeout "${SWEEP_S:-200}" python benchmarks/attention_sweep.py --out "$OUT/attn" --budget-s "${SWEEP_BUDGET_S:-150}" \
    > "$OUT/attn_sweep.log" 2>&1
echo "== sweep rc=$? $(elapsed)"; tail -n 25 "$OUT/attn_sweep.log"
if [[ -f "$OUT/attn/attention_env.sh" ]]; then
    # shellcheck disable=SC1091
    source "$OUT/attn/attention_env.sh"
    export SMCDECODE_ATTN_CONFIG SMCDECODE_ATTN_GROUP 2>/dev/null || true
fi

timeout "${VARIANTS_S:-140}" python benchmarks/engine_variants.py --sections e2e --out "$OUT/variants" \
    --out-len "${VARIANTS_OUT_LEN:-512}" --repeats 2 > "$OUT/variants.log" 2>&1
echo "== variants rc=$? $(elapsed)"; sed -n '/SUMMARY/,$p' "$OUT/variants.log"
env | grep '^SMCDECODE_' | sort | tee "$OUT/best_env.txt"
