export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
ls /tmp/model.gguf || exit 1
for m in alone full; do echo "=== $m $(date +%T)"
  timeout ${T:-400} python .carry/sh/ctx3.py $m 2>&1 | grep -v "it/s\]" > $OUT/ctx3_$m.txt; echo rc $?
  grep -E "SUMMARY|se exit|SE done|Traceback|Error" $OUT/ctx3_$m.txt | cut -c 1-400
  grep "G=8" $OUT/ctx3_$m.txt | grep -v automaton | grep SmolLM2 | sed 's/SmolLM2-135M-Instruct + shipped draft //' | cut -c 1-200
done
