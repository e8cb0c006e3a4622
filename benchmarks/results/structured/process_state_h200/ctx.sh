export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
ls /tmp/model.gguf || exit 1
echo "=== alone $(date +%T)"; timeout 100 python .carry/sh/ctx.py alone 2>&1 | grep -v "it/s\]" > $OUT/tl_alone.txt; echo rc $?
echo "=== after $(date +%T)"; timeout 440 python .carry/sh/ctx.py after 2>&1 | grep -v "it/s\]" > $OUT/tl_after.txt; echo rc $?
grep -E "FACTS|G=8 contact llguidance \(held" $OUT/tl_alone.txt $OUT/tl_after.txt | cut -c 1-600
