# contact x8: SmolLM2 alone, with a 2M-dict ballast in the process, and after the random models' contact rows
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
B="--smollm2-gguf /tmp/model.gguf --requests 8 --repeats 5 --only contact"
run() { tag=$1; t=$2; shift 2; echo "=== $tag $(date +%T)"; timeout $t python "$@" > $OUT/$tag.log 2>&1; echo "rc $?"; grep "G=8 contact llguidance (held" $OUT/$tag.log | cut -c 1-330; grep "^rss" $OUT/$tag.log; }
cat > /tmp/ballast.py <<'PY'
import runpy, sys, resource
n = int(sys.argv[1]); ballast = [{"k": i, "v": str(i)} for i in range(n)]
print("rss", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024, "MiB with", n, "dicts", flush=True)
sys.argv = ["structured_engine.py"] + sys.argv[2:]
runpy.run_path("benchmarks/structured_engine.py", run_name="__main__")
PY
run alone1 90 benchmarks/structured_engine.py $B --models smollm2 --out $OUT/alone1.json
run ballast1 100 /tmp/ballast.py 2000000 $B --models smollm2 --out $OUT/ballast1.json
run combined 170 benchmarks/structured_engine.py $B --models random,smollm2 --out $OUT/combined.json
run alone2 90 benchmarks/structured_engine.py $B --models smollm2 --out $OUT/alone2.json
run ballast2 100 /tmp/ballast.py 2000000 $B --models smollm2 --out $OUT/ballast2.json
