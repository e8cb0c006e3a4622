# A/B of the workers' watch before sleeping (mask_process.SPIN): 2 ms (as is) vs 20 ms (covers the gap between rounds)
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
cat > /tmp/spin.py <<'PY'
import runpy, sys
import smcdecode.backends.engine.mask_process as mp
mp.SPIN = float(sys.argv[1])
print("SPIN", mp.SPIN, flush=True)
sys.argv = ["structured_engine.py"] + sys.argv[2:]
runpy.run_path("benchmarks/structured_engine.py", run_name="__main__")
PY
B="--smollm2-gguf /tmp/model.gguf --models smollm2 --requests 8 --repeats 5 --only contact,tree"
i=0
for s in 0.002 0.02 0.02 0.002; do i=$((i+1)); echo "=== $i SPIN $s $(date +%T)"
  timeout 120 python /tmp/spin.py $s $B --out $OUT/spin_${i}_$s.json > $OUT/spin_${i}_$s.log 2>&1; echo "rc $?"
  grep "G=8" $OUT/spin_${i}_$s.log | grep -v automaton | sed 's/SmolLM2-135M-Instruct + shipped draft //' | cut -c 1-420
done
