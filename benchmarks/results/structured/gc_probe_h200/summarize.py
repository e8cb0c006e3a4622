"""Garbage collection in the run of this folder (``gcprobe.py``; raw: ``gclog_base.tgz``, one file per
process: the engine's process, and each mask worker from its fork on; each line a collection: time,
generation, µs, objects collected): per process kind, the collections by generation (count, total
and longest), and the engine's process's collections per 10 s of the run."""

import collections
import os
import tarfile

HERE = os.path.dirname(os.path.abspath(__file__))
logs = {}
with tarfile.open(os.path.join(HERE, "gclog_base.tgz")) as tar:
    for m in tar.getmembers():
        if m.isfile():
            logs[os.path.basename(m.name)] = tar.extractfile(m).read().decode().splitlines()
workers = {k: v for k, v in logs.items() if v and v[0].startswith("# worker forked")}
main = [k for k in logs if k not in workers]
print(f"{len(workers)} mask worker processes (forked {len(workers) // 8} times, eight at a time), engine's process: {main}")


def table(lines):
    by = collections.defaultdict(list)
    for line in lines:
        if not line.startswith("#"):
            _, g, us, _ = line.split()
            by[int(g)].append(int(us))
    return {g: (len(v), sum(v) / 1e3, max(v) / 1e3) for g, v in sorted(by.items())}


for name in main:
    print(f"engine's process: generation: (collections, total ms, longest ms) {table(logs[name])}")
every = collections.defaultdict(list)
for lines in workers.values():
    for g, (n, tot, mx) in table(lines).items():
        every[g].append((n, tot, mx))
print("mask workers, all together: generation: (collections, total ms, longest ms) " + str(
    {g: (sum(x[0] for x in v), round(sum(x[1] for x in v), 1), max(x[2] for x in v)) for g, v in sorted(every.items())}))
print(f"mask workers with no collection at all: {sum(not table(v) for v in workers.values())} of {len(workers)}")
lines = [line.split() for line in logs[main[0]] if not line.startswith("#")]
t0 = float(lines[0][0])
window = collections.defaultdict(float)
for t, _g, us, _ in lines:
    window[int((float(t) - t0) // 10) * 10] += int(us) / 1e3
print("engine's process, ms of collection per 10 s from its first collection: " +
      ", ".join(f"{k}s: {v:.0f}" for k, v in sorted(window.items())))
print("its collections over 3 ms: " + ", ".join(f"{float(t) - t0:.0f}s gen{g} {int(us) / 1e3:.0f} ms"
                                                for t, g, us, _ in lines if int(us) > 3000))
