"""Does a structured row's speed depend on what the process ran before it? The SmolLM2 contact record
on llguidance's path (eight requests, the strings' automata) measured as structured_engine.py measures
it, first thing after the engine's start, then in its place among the SmolLM2 rows of a full run, and
again at the end; with ``--random-first`` the random-weight rows of a full run come before all that,
as in a full run. Each row also records this process's resident and huge-page memory, its collector's
runs, and the mask workers' page faults per constrained call.

    PYTHONPATH=/tmp/site:$PWD python benchmarks/results/structured/row_history_h200/row_history.py --smollm2-gguf /tmp/model.gguf --out OUT.json [--random-first]
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # (benchmarks/, for structured_engine.py)
import structured_engine as se  # noqa: E402

from smcdecode.backends.engine import Engine, EngineConfig  # noqa: E402

_SNAPS: list = []


def children_stat() -> dict:
    """pid -> (minor faults, major faults, CPU s) of this process's children."""
    out = {}
    for p in multiprocessing.active_children():
        try:
            f = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        out[p.pid] = (int(f[7]), int(f[9]), (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK"))
    return out


def patched_children_cpu() -> dict:
    s = children_stat()
    _SNAPS.append(s)
    return {pid: v[2] for pid, v in s.items()}


def memory() -> dict:
    out = {}
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            k, _, v = line.partition(":")
            if k in ("Rss", "Anonymous", "AnonHugePages"):
                out[k] = int(v.split()[0]) // 1024
    except OSError:  # (no /proc/self/smaps_rollup: the row is recorded without its memory)
        pass
    return out


def row(tag: str, label: str, c, engine, model, P, eos, args, device) -> dict:
    t_plain, out = se.timed(lambda: engine.smc_sd(P, particles=args.particles, block_size=args.block_size,
                                                  max_new_tokens=args.max_new_tokens), 1, device)
    plain = se.generated(out) / statistics.median(t_plain)
    _SNAPS.clear()
    gc0 = [s["collections"] for s in gc.get_stats()]
    t0 = time.perf_counter()
    try:
        r = se.measure("SmolLM2", label, c, engine, model, P, eos, plain, t_plain, args, device)
    except RuntimeError as e:
        print(f"  [{tag}] {label} G={len(P)} {c.path}: {e}", flush=True)
        return {"tag": tag, "schema": label, "path": c.path, "requests": len(P), "error": str(e)}
    finally:
        engine.clear_graphs()
    a, b = _SNAPS[-2], _SNAPS[-1]
    faults = sum(b[p][0] - a[p][0] for p in b if p in a) / args.repeats
    major = sum(b[p][1] - a[p][1] for p in b if p in a) / args.repeats
    r |= {"tag": tag, "workers_minor_faults_per_constrained_call": faults,
          "workers_major_faults_per_constrained_call": major, "memory_mib": memory(),
          "gc_collections_during": [x - y for x, y in zip([s["collections"] for s in gc.get_stats()], gc0)],
          "row_seconds": time.perf_counter() - t0}
    print(f"  [{tag}] {label} G={len(P)} {c.path} held={c.held_strings}: {100 * r['ratio_same_length']:.1f} %, "
          f"ms/round {r['ms_per_round_constrained']:.2f}/{r['ms_per_round_plain_same_length']:.2f}, workers' faults "
          f"a call {faults:.0f} (major {major:.0f}), memory {r['memory_mib']}, gc {r['gc_collections_during']}",
          flush=True)
    return r


def compiled(schemas, model) -> dict:
    return {(label, path, held): se.bound(model, label, schema, path, held) for label, schema, path, held in schemas}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smollm2-gguf", required=True)
    ap.add_argument("--random-first", action="store_true")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cpu-check", action="store_true", help="the CPU, 24 tokens, two rows: checks the script")
    a = ap.parse_args()
    args = argparse.Namespace(particles=8, block_size=8, max_new_tokens=24 if a.cpu_check else 256, prompt_len=128, requests=[1, 8],
                              repeats=a.repeats, host_workers=2 if a.cpu_check else None, tiny=False, smollm2_gguf=a.smollm2_gguf)
    se.children_cpu = patched_children_cpu
    device, dtype = ("cpu", torch.float32) if a.cpu_check else ("cuda", torch.bfloat16)
    schemas = [("small object", se.DEFAULT_SCHEMA, "automaton", True), ("small object", se.DEFAULT_SCHEMA, "llguidance", True),
               ("small object", se.DEFAULT_SCHEMA, "llguidance", False), ("contact", se.CONTACT_SCHEMA, "auto", True),
               ("contact", se.CONTACT_SCHEMA, "llguidance", True), ("contact", se.CONTACT_SCHEMA, "llguidance", False)] + \
        [(lab, sc, p, True) for lab, sc in (("pattern keys", se.PATTERN_SCHEMA), ("open object", se.OPEN_SCHEMA))
         for p in ("auto", "llguidance")] + \
        [("tree", se.TREE_SCHEMA, "auto", True), ("tree, held strings", se.HELD_TREE_SCHEMA, "auto", True),
         ("tree, held strings", se.HELD_TREE_SCHEMA, "auto", False)]
    if a.cpu_check:
        schemas = schemas[3:5]
    res = {"random_first": a.random_first, "rows": [], "thp": {}}
    for k in ("enabled", "defrag"):
        try:
            res["thp"][k] = Path(f"/sys/kernel/mm/transparent_hugepage/{k}").read_text().strip()
        except OSError:  # (no such setting on this kernel: left out)
            pass
    print("THP", res["thp"], "python", sys.version.split()[0], flush=True)
    t_start = time.perf_counter()
    if a.random_first:
        name, target, draft, model, prompts, eos = se.random_models(args, device, dtype)
        max_ctx = max(len(p) for p in prompts) + args.max_new_tokens + 16
        pages = 8 * (args.particles + 4) * (-(-max_ctx // 16) + 1) + 64
        engine = Engine(target, draft, EngineConfig(num_pages=pages, page_size=16, max_context=max_ctx,
                                                    host_workers=args.host_workers))
        res["random_rows"] = se.run_model(name, engine, model, prompts, eos, schemas, args, device)
        del engine, target, draft
        if device == "cuda":
            torch.cuda.empty_cache()
        print(f"random rows done at {time.perf_counter() - t_start:.0f} s, memory {memory()}", flush=True)
    name, target, draft, model, prompts, eos = se.smollm2_models(args, device, dtype)
    max_ctx = max(len(p) for p in prompts) + args.max_new_tokens + 16
    pages = 8 * (args.particles + 4) * (-(-max_ctx // 16) + 1) + 64
    engine = Engine(target, draft, EngineConfig(num_pages=pages, page_size=16, max_context=max_ctx,
                                                    host_workers=args.host_workers))
    paths = compiled(schemas, model)
    contact = paths[("contact", "llguidance", True)]
    res["rows"].append(row("first", "contact", contact, engine, model, prompts[:8], eos, args, device))
    a.out.write_text(json.dumps(res, indent=1))
    for G in (1, 8):
        for (label, _, _), c in paths.items():
            res["rows"].append(row("in place", label, c, engine, model, prompts[:G], eos, args, device))
        a.out.write_text(json.dumps(res, indent=1))
    res["rows"].append(row("end", "contact", contact, engine, model, prompts[:8], eos, args, device))
    res["seconds"] = time.perf_counter() - t_start
    a.out.write_text(json.dumps(res, indent=1))
    print(f"done in {res['seconds']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
