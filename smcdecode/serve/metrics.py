"""Counters of a running server, rendered as Prometheus text (``GET /metrics``)."""

from __future__ import annotations

import os
import threading
from collections import Counter


class Stats:
    """Thread-safe counters: the HTTP layer counts requests by status, executors count work."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: Counter = Counter()  # (endpoint, status) -> count
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.particle_tokens = 0  # tokens generated over all particles / samples
        self.rounds = 0
        self.resampled_rounds = 0
        self.ess_sum = 0.0  # Σ over SMC rounds of ESS / N
        self.ess_rounds = 0
        self.cancelled = 0
        self.rejected = 0  # 429: the queue was full

    def count_request(self, endpoint: str, status: int) -> None:
        with self.lock:
            self.requests[(endpoint, status)] += 1

    def add(self, **amounts) -> None:
        with self.lock:
            for name, v in amounts.items():
                setattr(self, name, getattr(self, name) + v)


def _process() -> dict:
    """Resident memory, open file descriptors and threads of this process (Linux; else absent)."""
    out = {"smcdecode_process_threads": threading.active_count()}
    try:
        with open("/proc/self/statm") as f:
            out["smcdecode_process_resident_memory_bytes"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        out["smcdecode_process_open_fds"] = len(os.listdir("/proc/self/fd"))
    except (OSError, ValueError, IndexError):
        pass
    return out


HELP = {
    "smcdecode_requests_total": ("counter", "HTTP requests answered, by endpoint and status"),
    "smcdecode_prompt_tokens_total": ("counter", "prompt tokens of the requests run"),
    "smcdecode_completion_tokens_total": ("counter", "tokens of the returned choices"),
    "smcdecode_generated_tokens_total": ("counter", "tokens generated over all particles and samples"),
    "smcdecode_rounds_total": ("counter", "rounds run (SMC reweighting rounds, speculative draft-and-verify rounds)"),
    "smcdecode_resampled_rounds_total": ("counter", "SMC rounds that resampled"),
    "smcdecode_resampling_rate": ("gauge", "resampled SMC rounds / SMC rounds"),
    "smcdecode_mean_ess": ("gauge", "mean over SMC rounds of ESS / N"),
    "smcdecode_cancelled_total": ("counter", "requests cancelled because the client went away"),
    "smcdecode_rejected_total": ("counter", "requests refused with 429 because the queue was full"),
    "smcdecode_queue_length": ("gauge", "requests waiting to run"),
    "smcdecode_running": ("gauge", "requests running"),
    "smcdecode_kv_pages_in_use": ("gauge", "KV-cache pages in use (GPU engine)"),
    "smcdecode_process_threads": ("gauge", "threads of the server process"),
    "smcdecode_process_resident_memory_bytes": ("gauge", "resident memory of the server process"),
    "smcdecode_process_open_fds": ("gauge", "open file descriptors of the server process"),
}


def render(stats: Stats, executor_gauges: dict) -> str:
    """Prometheus text exposition format (version 0.0.4)."""
    with stats.lock:
        values = {
            "smcdecode_prompt_tokens_total": stats.prompt_tokens,
            "smcdecode_completion_tokens_total": stats.completion_tokens,
            "smcdecode_generated_tokens_total": stats.particle_tokens,
            "smcdecode_rounds_total": stats.rounds,
            "smcdecode_resampled_rounds_total": stats.resampled_rounds,
            "smcdecode_resampling_rate": stats.resampled_rounds / stats.ess_rounds if stats.ess_rounds else 0.0,
            "smcdecode_mean_ess": stats.ess_sum / stats.ess_rounds if stats.ess_rounds else 0.0,
            "smcdecode_cancelled_total": stats.cancelled,
            "smcdecode_rejected_total": stats.rejected,
        }
        requests = dict(stats.requests)
    values.update(executor_gauges)
    values.update(_process())
    lines = []
    name = "smcdecode_requests_total"
    lines += [f"# HELP {name} {HELP[name][1]}", f"# TYPE {name} counter"]
    for (endpoint, status), n in sorted(requests.items()):
        lines.append(f'{name}{{endpoint="{endpoint}",status="{status}"}} {n}')
    for name, v in values.items():
        kind, text = HELP[name]
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name} {v}"]
    return "\n".join(lines) + "\n"


def parse(text: str) -> dict:
    """Prometheus text back into {name or name{labels}: value} (for tests and benchmarks)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out
