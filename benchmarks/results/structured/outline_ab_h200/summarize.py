"""The A/B of this folder: each process's rows on llguidance's path with the strings' automata
(SmolLM2, eight requests), with the host's probe, and the medians over the four processes of each
variant, as ``../stopped_close_ab_h200/summarize.py`` prints them; then the contact record's rows of
the runs in ``contact_alone/``. ``python summarize.py before_numbers`` reads that folder's processes
instead."""

import glob
import json
import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
FOLDER = os.path.join(HERE, sys.argv[1]) if len(sys.argv) > 1 else HERE
sys.argv = [sys.argv[0], FOLDER]
runpy.run_path(os.path.join(HERE, "..", "stopped_close_ab_h200", "summarize.py"), run_name="__main__")
print("\ncontact_alone/ (the new tree, the contact record's rows only):")
for f in sorted(glob.glob(os.path.join(HERE, "contact_alone", "*.json"))):
    for r in json.load(open(f))["rows"]:
        if r["path"] == "llguidance" and r.get("held_strings"):
            probe = " / ".join(f"{x:.0f}" for x in r.get("host_probe_us") or [])
            print(f"{os.path.basename(f):12s} {r['requests']} request(s): {100 * r['ratio_same_length']:5.1f} %"
                  f"  ({r['ms_per_round_constrained']:.1f} vs {r['ms_per_round_plain_same_length']:.1f} ms a round; probe {probe})")
