export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
ls /tmp/model.gguf || exit 1
CLEAN=${CLEAN:-1} timeout 500 python .carry/sh/ctx2.py 2>&1 | grep -v "it/s\]" > $OUT/ctx2.txt; echo rc $?
grep -E "ALIVE|exit" $OUT/ctx2.txt | cut -c 1-1500
grep "G=8" $OUT/ctx2.txt | grep -v automaton | grep SmolLM2 | sed 's/SmolLM2-135M-Instruct + shipped draft //' | cut -c 1-260
