# contact in isolation vs inside a SmolLM2-only full run, same machine, same call
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
md5sum smcdecode/backends/engine/host_masks.py smcdecode/backends/engine/smc.py smcdecode/backends/engine/kernels/sampling.py
nproc; git log -1 --format=%h 2>/dev/null
run() { tag=$1; t=$2; shift 2; echo "=== $tag $(date +%T)"; timeout $t python benchmarks/structured_engine.py --smollm2-gguf /tmp/model.gguf --models smollm2 --repeats 5 --out $OUT/$tag.json "$@" > $OUT/$tag.log 2>&1; echo "rc $?"; grep "G=8 contact" $OUT/$tag.log; }
run only1 110 --only contact
run full 300
run only2 110 --only contact
