"""The calls of profile_mask_workers.py (40 seeded calls of one schema in one process, each drawing the
same tokens: the same work) against how long the mask workers took at their host points: prints,
per schema, the calls' times, the rank and linear correlations of a call's time with its host
points' mean time from a step record posted to the last worker done, and the median call time of the
ten calls whose workers took least and of the ten whose workers took most."""
import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent


def pearson(a: list, b: list) -> float:
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    num = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    return num / (sum((x - ma) ** 2 for x in a) ** 0.5 * sum((y - mb) ** 2 for y in b) ** 0.5)


def ranks(a: list) -> list:
    out = [0] * len(a)
    for k, i in enumerate(sorted(range(len(a)), key=a.__getitem__)):
        out[i] = k
    return out


for schema in ("contact", "small"):
    d = json.loads((HERE / f"mask_workers_calls_{schema}.json").read_text())
    calls = d["calls"]
    work = [c["parts_ms"]["workers"]["mean"] for c in calls]
    wall = [c["wall_ms"] for c in calls]
    order = sorted(range(len(calls)), key=work.__getitem__)
    print(f"{schema}: {len(calls)} calls of {sorted({c['rounds'] for c in calls})} rounds and "
          f"{sorted({c['host_points'] for c in calls})} host points; a call {min(wall):.1f}-{max(wall):.1f} ms "
          f"(median {statistics.median(wall):.1f}); workers a host point (mean over its points) "
          f"{min(work):.3f}-{max(work):.3f} ms; Spearman {pearson(ranks(work), ranks(wall)):.2f}, "
          f"Pearson {pearson(work, wall):.2f}; the ten calls whose workers took least: median "
          f"{statistics.median(wall[i] for i in order[:10]):.1f} ms, the ten that took most: "
          f"{statistics.median(wall[i] for i in order[-10:]):.1f} ms; unconstrained at the same lengths "
          f"{d['plain_ms_per_round']:.2f} ms a round against {d['ms_per_round']:.2f}")
