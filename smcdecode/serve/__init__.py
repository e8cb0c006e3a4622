"""An OpenAI-compatible HTTP server over smcdecode's strategies (``smcdecode serve``; docs/server.md).

Layout: ``protocol`` parses and checks a request into a :class:`~.protocol.Spec`; an *executor*
(``executor.LibraryExecutor`` over the public API, any backend; ``engine_executor.SchedulerExecutor``
over the GPU engine's continuous-batching scheduler) runs specs and reports text as it becomes final
(``watch``, ``stream``); ``app`` is the HTTP layer, which knows executors only through the
:class:`~.executor.Executor` interface; ``metrics`` renders Prometheus text.

The HTTP stack (starlette, uvicorn) is the optional extra ``smcdecode[serve]``.
"""

from __future__ import annotations

from ..errors import SMCDecodeError

EXTRA = "serve"
HTTP_PACKAGES = ("starlette", "uvicorn")


def require_http_stack() -> None:
    """Raise SMCDecodeError naming the extra when the HTTP packages are missing."""
    import importlib

    missing = []
    for name in HTTP_PACKAGES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise SMCDecodeError(
            f"smcdecode serve needs {' and '.join(missing)} (the optional extra '{EXTRA}'): "
            f"pip install 'smcdecode[{EXTRA}]'"
        )
