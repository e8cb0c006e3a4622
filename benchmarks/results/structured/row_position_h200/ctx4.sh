export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
ls /tmp/model.gguf || exit 1
for m in ${MODES:-only all}; do echo "=== $m $(date +%T)"
  timeout ${T:-250} python .carry/sh/ctx4.py $m 2>&1 | grep -v "it/s\]" > $OUT/ctx4_$m.txt; echo rc $?
  grep -E "ABAB|se exit|SE done|Traceback|Error" $OUT/ctx4_$m.txt | cut -c 1-150
  grep "G=8 contact llguidance (held" $OUT/ctx4_$m.txt | grep -v "plain 1 tok" | sed 's/SmolLM2-135M-Instruct + shipped draft //' | cut -c 1-150
done
