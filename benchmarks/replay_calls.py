"""One recorded ``HostMasks`` call of a trace (``host_masks_replay.py record``) made again on a
``HostMasks``: shared by the scripts that replay traces (host_masks_replay.py, worker_step_time.py),
which run it in processes importing smcdecode from the tree they time."""

import json
import sys

import torch


def start() -> tuple:
    """In a replay's process: its configuration (``sys.argv[1]``, JSON), torch on one thread, and the
    default model of the smcdecode it imports (the tree it times)."""
    import smcdecode as sd

    cfg = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    return cfg, sd.load_model()


def replay_call(host, name: str, a, bits, handed: dict) -> None:
    """The call ``name`` with its recorded arguments ``a`` (every kind but "add", which the caller
    makes with its constraint); ``bits``: the masks' buffer; ``handed``: ``{"handed": True}`` where
    the tree's ``HostMasks.begin`` takes it (the drafted columns then go through ``hand_over``, as the
    engine's round hands them over), else ``{}``."""
    if name == "remove":
        host.remove(a)
    elif name == "begin":
        host.begin(a[0], a[1], torch.zeros(a[0], max(a[1], 1), dtype=torch.long), **handed)
    elif name == "mask":
        host.mask(a, bits[: host.rows])
    elif name == "drafted" and handed and a[0] < host.k_max:
        host.hand_over(a[0], torch.tensor(a[1], dtype=torch.long))
    elif name == "drafted":
        host.drafted(a[0], torch.tensor(a[1], dtype=torch.long))
    elif name == "end":
        host.end(torch.tensor(a, dtype=torch.long), None)
    elif name == "fork":
        host.fork(torch.tensor(a, dtype=torch.long))
    elif name == "rejects":
        host.rejects(a)
