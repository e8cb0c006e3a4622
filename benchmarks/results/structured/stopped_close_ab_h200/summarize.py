"""The A/B of this folder: each process's rows on llguidance's path with the strings' automata
(SmolLM2, eight requests), with the host's probe (``host_probe_us``: µs a fixed piece of pure Python
took just before and just after the row's timed calls), and the medians over the four processes of
each variant. ``python summarize.py FOLDER`` reads another folder's ``ab_*.json`` the same way
(``outline_ab_h200/summarize.py`` does)."""

import glob
import json
import os
import statistics
import sys

HERE = os.path.abspath(sys.argv[1]) if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
rows: dict = {}
print("process  variant  schema        ratio   ms/round constrained vs plain   extra ms/round   host probe (µs, before and after)")
for f in sorted(glob.glob(os.path.join(HERE, "ab_*.json")), key=lambda p: int(os.path.basename(p).split("_")[1])):
    name = os.path.basename(f)[:-5]
    variant = name.split("_")[2]
    for r in json.load(open(f))["rows"]:
        if r["path"] != "llguidance" or not r.get("held_strings"):
            continue
        c, p = r["ms_per_round_constrained"], r["ms_per_round_plain_same_length"]
        rows.setdefault((r["schema"], variant), []).append((r["ratio_same_length"], c, p))
        probe = " / ".join(f"{x:.0f}" for x in r.get("host_probe_us") or [])
        print(f"{name:9s} {variant:7s} {r['schema']:13s} {100 * r['ratio_same_length']:5.1f} %  {c:5.1f} vs {p:5.1f}"
              f"                  {c - p:4.1f}            {probe}")
print("\nmedians over the processes of each variant:")
for (schema, variant), v in sorted(rows.items()):
    med = [statistics.median(x[i] for x in v) for i in range(3)]
    print(f"{schema:13s} {variant:4s} ({len(v)} processes): ratio {100 * med[0]:.1f} %, constrained rounds {med[1]:.1f} ms,"
          f" unconstrained {med[2]:.1f} ms, extra per round {statistics.median(x[1] - x[2] for x in v):.1f} ms")
