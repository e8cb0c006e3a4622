"""The host points of the worker-served rounds timed by ``ptprobe.py`` (raw: ``ptlog_a.tgz``, one file per
mask worker process: per round it served (``p`` seq points base time), the time each point's flag was
seen (``h`` count time) and each point's work (``w`` items rows start end); CLOCK_MONOTONIC seconds,
comparable across processes). The processes come in sets of eight, one set per row, in the order of
the rows: the contact record with the strings' automata, with llguidance's walk, then the tree.
Per host point 1 … 7 of each round: from the first worker seeing the device's flag to the last
worker done (``host``), from then to the next flag seen (``device``), and the slowest worker's work."""

import collections
import os
import statistics
import tarfile

HERE = os.path.dirname(os.path.abspath(__file__))
files: dict = {}
with tarfile.open(os.path.join(HERE, "ptlog_a.tgz")) as tar:
    for m in tar.getmembers():
        if m.isfile():
            files[int(os.path.basename(m.name)[:-4])] = tar.extractfile(m).read().decode().splitlines()
pids = sorted(files)
SETS = ["contact, strings' automata", "contact, llguidance's walk", "tree, strings' automata"]
for s, name in enumerate(SETS):
    # a round: the records of one sequence number, one per worker it concerned
    by_worker: dict = collections.defaultdict(list)
    for pid in pids[8 * s: 8 * s + 8]:
        cur = None
        for line in files[pid]:
            p = line.split()
            if p[0] == "p":
                cur = {"seq": int(p[1]), "points": int(p[2]), "base": int(p[3]), "h": {}, "w": []}
            elif p[0] == "h" and cur:
                cur["h"][int(p[1]) - cur["base"]] = float(p[2])
            elif p[0] == "w" and cur:
                cur["w"].append((float(p[3]), float(p[4])))
            elif p[0] == "e" and cur:
                by_worker[cur["seq"]].append(cur)
                cur = None
    host, device, slowest, rounds = [], [], [], 0
    for _, ws in sorted(by_worker.items()):
        if len(ws) < 2:
            continue
        rounds += 1
        for i in range(1, max(w["points"] for w in ws) - 1):
            flags = [w["h"][i] for w in ws if i in w["h"]]
            nxt = [w["h"][i + 1] for w in ws if i + 1 in w["h"]]
            ends, works = [], []
            for w in ws:
                if i in w["h"]:
                    mine = [x for x in w["w"] if x[0] >= w["h"][i] - 1e-6 and (i + 1 not in w["h"] or x[1] <= w["h"][i + 1])]
                    if mine:
                        ends.append(mine[0][1])
                        works.append(mine[0][1] - mine[0][0])
            if flags and nxt and ends:
                host.append(1e6 * (max(ends) - min(flags)))
                device.append(1e6 * (min(nxt) - max(ends)))
                slowest.append(1e6 * max(works))

    def q(x):
        x = sorted(x)
        return (f"median {statistics.median(x):4.0f}  mean {statistics.mean(x):4.0f}  p90 {x[9 * len(x) // 10]:5.0f}  "
                f"max {x[-1]:5.0f} µs")

    print(f"{name} ({rounds} rounds, {len(host)} host points):")
    print(f"  host (flag seen -> last worker done): {q(host)}")
    print(f"  device (last worker done -> next flag): {q(device)}")
    print(f"  slowest worker's work:                {q(slowest)}")
    dear = [x for x in slowest if x > 600]
    print(f"  points whose slowest work took over 0.6 ms: {len(dear)}"
          + (f" ({min(dear) / 1e3:.2f}-{max(dear) / 1e3:.2f} ms)" if dear else "")
          + f"; their share of the host time: {100 * sum(h for h, x in zip(host, slowest) if x > 600) / sum(host):.0f} %")
    rest = [x for x in slowest if x <= 600]
    print(f"  the other {len(rest)}: under 0.1 ms {sum(x < 100 for x in rest)}, 0.1-0.3 ms "
          f"{sum(100 <= x <= 300 for x in rest)}, 0.3-0.6 ms {sum(x > 300 for x in rest)}")
