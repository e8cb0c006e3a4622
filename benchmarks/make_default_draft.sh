#!/usr/bin/env bash
# Makes the shipped default draft (smcdecode/drafts/smollm2-135m-instruct), its held-out acceptance
# table and the SMC-SD fidelity study on one CUDA GPU. Three stages, each fits one 10-minute device
# call (STAGE=corpus, then train, then eval; STAGE=all runs them in a row):
#
#   GGUF=.../SmolLM2-135M-Instruct.Q4_1.gguf DATA=.../data/eval W=/tmp/w OUT=out STAGE=all \
#       bash benchmarks/make_default_draft.sh
#
# corpus  `smcdecode.distill --steps 1`: the target samples SAMPLES answers (T=0.7, <= 256 tokens)
#         per training prompt — ShareGPT + AlpacaEval (200 held out, 64 for validation) and, for
#         training only, GSM8K, MATH500 and Spec-Bench questions — for at most GEN_BUDGET seconds.
# train   for each L in LAYERS, concurrently: the same command on a copy of that corpus, resumed
#         with --steps large and --time-budget TRAIN_BUDGET, --eval-every 250 (the draft with the
#         lowest validation KL is kept), then the held-out evaluation of the saved (int8) draft.
# single  corpus and training of one draft in one command (GENERATOR=engine makes the corpus
#         many times faster on the GPU: smcdecode's own engine instead of transformers' generate).
# eval    benchmarks/draft_acceptance.py (distilled drafts vs truncated ones on the held-out
#         answers) and benchmarks/draft_fidelity.py (SMC-SD K=4/8 and exact SD with the draft DRAFT;
#         PHASE1_RESULTS=DIR reuses the target / truncated-draft answers of an earlier run on the
#         same held-out prompts, else they run here too).
set -euo pipefail
: "${GGUF:?path of the target GGUF}" "${DATA:?folder with the eval prompt files}"
W=${W:-/tmp/w}
OUT=${OUT:-out}
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
STAGE=${STAGE:-all}
LAYERS=${LAYERS:-4 6}
export SMCDECODE_CACHE=${SMCDECODE_CACHE:-$W/cache} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$W" "$OUT"
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
EXTRA=${EXTRA:-"$DATA/gsm8k_test.jsonl $DATA/math500.jsonl $DATA/spec_bench_questions.jsonl"}
PROMPTS=(--prompts "$DATA/sharegpt_500.json" "$DATA/alpaca_eval_instructions.json" --extra-prompts $EXTRA)
COMMON=(--target "$GGUF" "${PROMPTS[@]}" --device "$DEVICE" --no-progress --samples-per-prompt "${SAMPLES:-8}"
        --generator "${GENERATOR:-hf}"
        --generation-batch-size "${GEN_BATCH:-1024}" --generation-time-budget "${GEN_BUDGET:-420}"
        --eval-every "${EVAL_EVERY:-250}" --batch-size "${BATCH:-64}" --lr "${LR:-5e-4}"
        --warmup-steps "${WARMUP:-100}" --checkpoint-every 500 ${DISTILL_ARGS:-})

if [[ $STAGE == corpus || $STAGE == all ]]; then
    "$PY" -m smcdecode.distill "${COMMON[@]}" --layers 4 --out "$W/corpus" --steps 1
    echo "== corpus done (elapsed $(elapsed) s)"
fi

if [[ $STAGE == single ]]; then  # corpus and training of one draft (the first of LAYERS) in one command
    L=${LAYERS%% *}
    "$PY" -m smcdecode.distill "${COMMON[@]}" --layers "$L" --out "$W/d$L" --steps 1000000 \
        --time-budget "${TRAIN_BUDGET:-420}" 2>&1 | grep -v -i warn | tee "$W/train_L$L.log" | tail -n 40
    mkdir -p "$W/corpus" && cp "$W/d$L/corpus.pt" "$W/corpus/"
    mkdir -p "$OUT/d$L" && cp "$W/d$L/draft.json" "$W/d$L/eval.json" "$W/train_L$L.log" "$OUT/d$L/"
    echo "== corpus and training done (elapsed $(elapsed) s)"
fi

if [[ $STAGE == train || $STAGE == all ]]; then
    PIDS=()
    for L in $LAYERS; do
        mkdir -p "$W/d$L" && cp "$W/corpus/corpus.pt" "$W/d$L/"
        "$PY" -m smcdecode.distill "${COMMON[@]}" --layers "$L" --out "$W/d$L" --steps 1000000 \
            --time-budget "${TRAIN_BUDGET:-420}" > "$W/train_L$L.log" 2>&1 &
        PIDS+=($!)
    done
    for p in "${PIDS[@]}"; do wait "$p" || echo "a training run failed"; done
    for L in $LAYERS; do
        echo "== $L layers"; grep -v -i warn "$W/train_L$L.log" | tail -n 25
        mkdir -p "$OUT/d$L" && cp "$W/d$L/draft.json" "$W/d$L/draft.safetensors" "$W/d$L/eval.json" "$OUT/d$L/"
        cp "$W/train_L$L.log" "$OUT/"
    done
    echo "== training done (elapsed $(elapsed) s)"
fi

if [[ $STAGE == eval || $STAGE == all ]]; then
    : "${DRAFT:=$W/d4}"
    DRAFTS=()
    for L in $LAYERS; do DRAFTS+=("$W/d$L"); done
    "$PY" benchmarks/draft_acceptance.py --target "$GGUF" --draft "${DRAFTS[@]}" --corpus "$W/corpus/corpus.pt" \
        --device "$DEVICE" --temperature 0.7 1.0 --out "$OUT/acceptance.json" ${ACCEPTANCE_ARGS:-} \
        > "$W/acceptance.log" 2>&1 &
    PA=$!
    FID=(--target "$GGUF" --prompts "$DATA/sharegpt_500.json" "$DATA/alpaca_eval_instructions.json"
         --device "$DEVICE" --results-dir "$W/fid" --max-new-tokens "${FID_TOKENS:-64}" ${FIDELITY_ARGS:-})
    METHODS=(smc_k4 smc_k8 sd_k4)
    if [[ -n "${PHASE1_RESULTS:-}" ]]; then
        mkdir -p "$W/fid" && cp "$PHASE1_RESULTS"/worker*-target-smc_trunc_k4.jsonl "$W/fid/"
    else
        METHODS=(target smc_k4 smc_k8 sd_k4 smc_trunc_k4)
    fi
    "$PY" benchmarks/draft_fidelity.py "${FID[@]}" --draft "$DRAFT" --methods "${METHODS[@]}" \
        --workers "${WORKERS:-12}" --budget "${FID_BUDGET:-480}" --out "$OUT/fidelity.json" || echo "fidelity failed"
    wait $PA || echo "acceptance table failed"
    grep -v -i warn "$W/acceptance.log" || true
    tar czf "$OUT/fidelity_runs.tar.gz" -C "$W" fid
    echo "== eval done (elapsed $(elapsed) s)"
fi
