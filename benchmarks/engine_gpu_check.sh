#!/usr/bin/env bash
# One device call that checks the engine on one NVIDIA GPU and then runs the published benchmark,
# writing everything into $OUT:
#
#   1. the engine's GPU tests (pytest -m gpu; TESTS: kernels, pipelined rounds,
#      statistics, model, prefill by default)                                 -> gpu_tests.log
#   2. benchmarks/bench_engine.py (docs/benchmarks.md's table)                  -> benchmarks.json, benchmarks.md, profile.txt
#
#   OUT=/tmp/check bash benchmarks/engine_gpu_check.sh      # ~9 minutes on an H200
#
# Each step has its own time limit (TESTS_S, BENCH_S) so one slow step cannot take the other's time.
# BENCH_ARGS passes more options to bench_engine.py (e.g. "--smollm2-gguf PATH").
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

# shellcheck disable=SC2086
timeout "${BENCH_S:-330}" python benchmarks/bench_engine.py --out-dir "$OUT" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
echo "== benchmark rc=$? $(elapsed)"; tail -n 20 "$OUT/bench.log"
