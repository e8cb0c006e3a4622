#!/usr/bin/env bash
# Makes the shipped default draft (smcdecode/drafts/smollm2-135m-instruct), its held-out acceptance
# table and the SMC-SD fidelity study, on one CUDA GPU, inside one device call (TOTAL_BUDGET s).
#
#   GGUF=.../SmolLM2-135M-Instruct.Q4_1.gguf DATA=.../data/eval W=/tmp/w OUT=out \
#       bash benchmarks/make_default_draft.sh
#
# 1. `smcdecode.distill --steps 1`: the target samples its corpus (SAMPLES answers per training
#    prompt, 1 per held-out prompt, T=0.7, 256 tokens) and trains one step, so the time left is known;
# 2. the same command again resumes and trains for the rest of the budget less RESERVE seconds;
#    meanwhile (PHASE1=alongside) benchmarks/draft_fidelity.py runs the methods that need no
#    distilled draft (target samples, SMC-SD with the truncated draft) on the held-out prompts;
#    PHASE1=after runs them with the others after training (training alone runs ~4x faster);
#    INIT_DRAFT=DIR warm-starts from a saved draft;
# 3. benchmarks/draft_acceptance.py (distilled vs truncated drafts on the held-out samples) and
#    draft_fidelity.py for the distilled-draft methods (SMC-SD K=4, K=8; exact SD K=4), which then
#    pools both halves over the prompts that every method completed.
set -euo pipefail
: "${GGUF:?path of the target GGUF}" "${DATA:?folder with sharegpt_500.json and alpaca_eval_instructions.json}"
W=${W:-/tmp/w}
OUT=${OUT:-out}
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
TOTAL=${TOTAL_BUDGET:-570}
export SMCDECODE_CACHE=${SMCDECODE_CACHE:-$W/cache} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$W" "$OUT"
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
PROMPTS=("$DATA/sharegpt_500.json" "$DATA/alpaca_eval_instructions.json")
RECIPE=(--target "$GGUF" --prompts "${PROMPTS[@]}" --out "$W/draft" --device "$DEVICE" --no-progress
        --layers "${LAYERS:-4}" --samples-per-prompt "${SAMPLES:-4}" --generation-batch-size "${GEN_BATCH:-1024}"
        --batch-size "${BATCH:-32}" --lr "${LR:-5e-4}" --warmup-steps "${WARMUP:-100}" --checkpoint-every 500
        ${INIT_DRAFT:+--init-draft "$INIT_DRAFT"} ${DISTILL_ARGS:-})
FID=(--target "$GGUF" --prompts "${PROMPTS[@]}" --device "$DEVICE" --results-dir "$W/fid"
     --max-new-tokens "${FID_TOKENS:-64}" ${FIDELITY_ARGS:-})

"$PY" -m smcdecode.distill "${RECIPE[@]}" --steps 1
LEFT=$(( TOTAL - $(elapsed) - ${RESERVE:-270} ))
if (( LEFT < 10 )); then LEFT=10; fi
echo "== training for $LEFT s, fidelity (target, truncated) alongside (elapsed $(elapsed) s)"
PHASE2_METHODS=(smc_k4 smc_k8 sd_k4)
if [[ -n "${PHASE1_RESULTS:-}" ]]; then  # target / truncated-draft runs of an earlier call: they need no draft
    mkdir -p "$W/fid" && cp "$PHASE1_RESULTS"/worker*-target-smc_trunc_k4.jsonl "$W/fid/"
    P1=""
elif [[ "${PHASE1:-alongside}" == after ]]; then  # all methods after training (training runs alone, faster)
    PHASE2_METHODS=(target smc_k4 smc_k8 sd_k4 smc_trunc_k4)
    P1=""
else
    "$PY" benchmarks/draft_fidelity.py "${FID[@]}" --methods target smc_trunc_k4 --workers "${WORKERS1:-6}" \
        --budget "$LEFT" --out "$W/fidelity_phase1.json" > "$W/fidelity_phase1.log" 2>&1 &
    P1=$!
fi
"$PY" -m smcdecode.distill "${RECIPE[@]}" --steps 1000000 --time-budget "$LEFT"
cp "$W/draft/draft.json" "$W/draft/draft.safetensors" "$W/draft/eval.json" "$OUT/"
"$PY" -c "import torch, sys; c = torch.load(sys.argv[1], weights_only=True); \
torch.save({k: c[k] for k in ('heldout', 'heldout_prompts')}, sys.argv[2])" \
    "$W/draft/corpus.pt" "$OUT/heldout_corpus.pt" || echo "held-out corpus copy failed"
P2=""
if [[ "${ACCEPTANCE:-1}" == 1 ]]; then
    echo "== acceptance table alongside the distilled-draft fidelity runs (elapsed $(elapsed) s)"
    "$PY" benchmarks/draft_acceptance.py --target "$GGUF" --draft "$W/draft" --corpus "$W/draft/corpus.pt" \
        --device "$DEVICE" --temperature 0.7 1.0 --out "$OUT/acceptance.json" ${ACCEPTANCE_ARGS:-} \
        > "$W/acceptance.log" 2>&1 &
    P2=$!
fi
if [[ -n "$P1" ]]; then
    wait $P1 || echo "fidelity phase 1 failed"
    tail -n 12 "$W/fidelity_phase1.log"
fi
LEFT2=$(( TOTAL - $(elapsed) - ${TAIL_RESERVE:-25} ))
if (( LEFT2 < 10 )); then LEFT2=10; fi
echo "== fidelity (distilled draft) for $LEFT2 s (elapsed $(elapsed) s)"
"$PY" benchmarks/draft_fidelity.py "${FID[@]}" --draft "$W/draft" --methods "${PHASE2_METHODS[@]}" \
    --workers "${WORKERS2:-12}" --budget "$LEFT2" --out "$OUT/fidelity.json" || echo "fidelity phase 2 failed"
if [[ -n "$P2" ]]; then
    wait $P2 || echo "acceptance table failed"
    grep -v -i warn "$W/acceptance.log" || true
fi
tar czf "$OUT/fidelity_runs.tar.gz" -C "$W" fid
echo "== done in $(elapsed) s"
