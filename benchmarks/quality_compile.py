"""Schema compilation for ``structured_quality.py`` in a pool of processes, ahead of the GPU.

Compiling a JSONSchemaBench schema is CPU work (p50 0.45 s, p99 7.3 s, a long tail past 50 s:
``benchmarks/results/schema_compile.json``), most of it the token walk of the automaton path. The
benchmark's GPU process submits every schema here in the order it will run them and takes each result
when its engine call comes up, so compiling overlaps the engine calls instead of stalling them.

A pool process loads the model once (for its vocabulary), compiles ``JSONSchema(schema,
extra_properties=False)`` on path "auto" (an automaton compile past the timeout runs on llguidance)
and returns the constraint's state without the parts that cannot cross processes (the model, the
llguidance matcher and executor, the jsonschema validator, character automata); :func:`restore` binds
that state to the GPU process's model again: an automaton (the superset path's too) is reused as
compiled, an llguidance grammar is bound there (milliseconds).
"""

from __future__ import annotations

import multiprocessing
import signal
import time

_MODEL = None
# (a character automaton does not pickle: interegular's "anything else" symbol is compared by identity)
_LOCAL = ("model", "_template", "_tok", "_base_tok", "_lanes", "_executor", "_keys", "validator", "_fsm", "_superset_fsm")


class _Timeout(BaseException):
    """A schema's compile ran past the timeout (a BaseException: the library's handlers of its
    dependencies' errors, ``except Exception``, must not turn it into a compile error)."""


_FIRED = []  # (the alarm went off: numpy turns an exception raised inside its comparisons into a TypeError)


def _alarm(signum, frame):
    _FIRED.append(True)
    raise _Timeout


def _timed_out(e: BaseException) -> bool:
    return isinstance(e, _Timeout) or bool(_FIRED)


def compile_constraint(schema, model, timeout: float, threads: int | None, path: str = "auto"):
    """(bound JSONSchema or None, info): ``path`` ("auto": as generate_json compiles it); an automaton compile
    past ``timeout`` seconds runs on llguidance instead; a schema neither path takes gives None and
    the reason. Runs in the main thread of its process (SIGALRM bounds the time)."""
    from smcdecode.errors import SMCDecodeError
    from smcdecode.potentials.json_schema import JSONSchema

    t0 = time.perf_counter()
    info = {"compiled": False, "path": None}
    old = signal.signal(signal.SIGALRM, _alarm)
    _FIRED.clear()
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            c = JSONSchema(schema, extra_properties=False, threads=threads, path=path)
            info["path"], info["reason"] = c.path, c.path_reason
            c = c.bind(model)
            info["path"], info["reason"] = c.path, c.path_reason  # (bound: a fallback to llguidance says so)
        except BaseException as e:  # (JSONSchema's constructor spends its time on the automaton; bind, on either path)
            if not _timed_out(e) or info["path"] not in (None, "automaton", "superset"):
                raise
            _FIRED.clear()
            signal.setitimer(signal.ITIMER_REAL, timeout)
            info["reason"] = f"automaton compile over {timeout:g} s: llguidance"
            c = JSONSchema(schema, extra_properties=False, threads=threads, path="llguidance").bind(model)
            info["path"] = "llguidance"
        info["compiled"] = True
    except BaseException as e:  # (every failure is a row, never a crash; a KeyboardInterrupt stops)
        if _timed_out(e):
            c, info["path"], info["reason"] = None, None, f"compile over {timeout:g} s"
        elif isinstance(e, SMCDecodeError):
            c, info["path"], info["reason"] = None, None, _short(str(e))
        elif isinstance(e, Exception):
            c, info["path"], info["reason"] = None, None, _short(f"{type(e).__name__}: {e}")
        else:
            raise
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    info["compile_s"] = time.perf_counter() - t0
    return c, info


def _short(reason: str, most: int = 400) -> str:
    """``reason`` in at most about ``most`` characters: its start and its end (where a message that
    quotes a long regex says what went wrong)."""
    return reason if len(reason) <= most else f"{reason[: most - 150]} … {reason[-140:]}"


def portable(c) -> dict | None:
    """The state of a compiled constraint that crosses processes (None for None)."""
    if c is None:
        return None
    return {k: v for k, v in c.__dict__.items() if k not in _LOCAL}


def restore(state: dict | None, model):
    """The constraint of :func:`portable`'s ``state`` bound to ``model`` (None for None)."""
    from smcdecode.potentials.json_schema import JSONSchema, check_schema

    if state is None:
        return None
    c = JSONSchema.__new__(JSONSchema)
    c.__dict__.update(state)
    c.validator = check_schema(c.schema)
    c.model, c._fsm, c._superset_fsm = None, None, None
    if c.path == "automaton":
        c.model = model  # the token automaton was built for this model's vocabulary in the pool
        return c
    c._template = c._executor = c._keys = None
    return c.bind(model)


def _init(model_path: str) -> None:
    global _MODEL
    import torch

    import smcdecode as sd

    torch.set_num_threads(1)
    _MODEL = sd.load_model(model_path, dtype="float32")


def _job(k: int, schema, timeout: float, threads: int | None, path: str):
    c, info = compile_constraint(schema, _MODEL, timeout, threads, path)
    return k, portable(c), info


class CompilePool:
    """``procs`` processes compiling schemas in submission order; :meth:`get` waits for one."""

    def __init__(self, procs: int, model_path: str, timeout: float, threads: int | None, path: str = "auto"):
        self.timeout, self.threads, self.path = timeout, threads, path
        # spawn: the GPU process may already hold CUDA, which a forked child must not touch
        self.pool = multiprocessing.get_context("spawn").Pool(procs, initializer=_init, initargs=(model_path,))
        self.pending: dict = {}

    def submit(self, k: int, schema) -> None:
        if k not in self.pending:
            self.pending[k] = self.pool.apply_async(_job, (k, schema, self.timeout, self.threads, self.path))

    def get(self, k: int, model, wait: float) -> tuple[object, dict]:
        """(bound constraint or None, info) of schema ``k``: waits at most ``wait`` seconds (a result
        that does not come is a row saying so: a lost or stuck pool process)."""
        t0 = time.perf_counter()
        try:
            _, state, info = self.pending.pop(k).get(timeout=wait)
        except multiprocessing.TimeoutError:
            return None, {"compiled": False, "path": None, "reason": f"no compile result in {wait:g} s",
                          "compile_s": None}
        info["wait_s"] = time.perf_counter() - t0
        try:
            return restore(state, model), info
        except Exception as e:  # noqa: BLE001 - a grammar llguidance rejects at bind: a row, not a crash
            return None, {**info, "compiled": False, "path": None, "reason": f"{type(e).__name__}: {e}"[:400]}

    def close(self) -> None:
        self.pool.terminate()
        self.pool.join()
