# old (a2a10a5) and new trees alternately (old new new old): SmolLM2 x8 contact and tree rows
G=/tmp/model.gguf
i=${START:-0}
for v in ${ORDER:-old new new old}; do
  i=$((i+1))
  if [ $v = old ]; then PP=/tmp/site:/tmp/oldpkg; else PP=/tmp/site:$PWD; fi
  PYTHONPATH=$PP timeout ${TO:-110} python benchmarks/structured_engine.py --smollm2-gguf $G --models smollm2 --requests 8 --only "${ONLY:-contact,tree}" --repeats 5 --out $OUT/ab_${i}_${v}.json > $OUT/ab_${i}_${v}.log 2>&1
  echo "== $i $v rc=$?"; grep -E "\| 8 \|" $OUT/ab_${i}_${v}.log | cut -c1-200
done
