"""Text that can no longer change, as it grows; stop sequences; the response and chunk bodies.

A :class:`TextStream` turns the final token ids of one choice (see ``watch``) into text deltas.
It holds back a trailing incomplete UTF-8 character and any tail that could be the start of a stop
sequence, and ends the text before the first stop sequence, so the deltas it sends always
concatenate to a prefix of the choice's final text; :meth:`TextStream.finish` sends the rest.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from ..errors import SMCDecodeError


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """``text`` up to the first occurrence of any stop sequence, and whether one occurred."""
    first = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text, False) if first < 0 else (text[:first], True)


def _held_back(text: str, stops: list[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a stop sequence."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return hold


class TextStream:
    """Deltas of one choice's text (see the module docstring).

    The text of the growing ids is decoded incrementally: the text of the first ``base`` ids is
    kept, and each update decodes only the ids from ``WINDOW`` tokens before ``base`` on (tokenizers
    that join or clean up text across tokens see their context), taking what that decode adds to
    the decode of the window alone; where the window's text is not a prefix of it, the whole text
    is decoded again. ``base`` moves up to ``WINDOW`` tokens before the end, where the text decoded
    so far ends in a complete character."""

    WINDOW = 8

    def __init__(self, decode: Callable[[list[int]], str], stops: list[str]):
        self.decode, self.stops = decode, stops
        self.sent = ""
        self.ids: list[int] = []  # the final token ids last seen
        self.stopped = False  # a stop sequence is in the final text: nothing more will be sent
        self._base, self._base_text = 0, ""  # the first ``_base`` ids decode to ``_base_text``

    def _since(self, ids: list[int], end: int) -> str | None:
        """The text of ids[:end] from the kept text and a decode of the window before it, or None."""
        c = max(0, self._base - self.WINDOW)
        head = self.decode(ids[c:self._base]) if c < self._base else ""
        tail = self.decode(ids[c:end])
        return self._base_text + tail[len(head):] if tail.startswith(head) else None

    def _text(self, ids: list[int]) -> str:
        text = self._since(ids, len(ids)) if self._base else None
        if text is None:
            self._base, self._base_text = 0, ""
            text = self.decode(ids)
        move = len(ids) - self.WINDOW
        if move > self._base + self.WINDOW:
            kept = self._since(ids, move) if self._base else self.decode(ids[:move])
            if kept is not None and not kept.endswith("\ufffd") and text.startswith(kept):
                self._base, self._base_text = move, kept
        return text

    def update(self, ids: list[int]) -> str:
        """The new text of ``ids`` (final token ids, growing), or "" while nothing new is certain."""
        if self.stopped:
            return ""
        text = self._text(ids).rstrip("\ufffd")  # an incomplete UTF-8 character at the end
        text, self.stopped = cut_at_stop(text, self.stops)
        if not self.stopped:
            text = text[: len(text) - _held_back(text, self.stops)]
        if not text.startswith(self.sent):  # a tokenizer that rewrites earlier text: wait for the end
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta

    def finish(self, final_text: str) -> tuple[str, str, bool]:
        """(the rest of the text, the whole text, whether a stop sequence ended it)."""
        text, stopped = cut_at_stop(final_text, self.stops)
        if not text.startswith(self.sent):
            # NOTE: the sent text is a prefix of every particle's text, so this is a bug, not bad input
            raise SMCDecodeError(f"internal error: the streamed text {self.sent[-40:]!r} is not a prefix of the "
                                 f"final text {text[:80]!r}")
        rest, self.sent = text[len(self.sent):], text
        return rest, text, stopped


def sse(data: dict | str) -> bytes:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


def chunk(job, index: int, text: str | None = None, finish_reason: str | None = None, role: bool = False,
          logprobs=None) -> dict:
    """A ``chat.completion.chunk`` or streamed ``text_completion`` for choice ``index``."""
    if job.spec.endpoint == "chat":
        delta = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        kind = "text_completion"
    return {"id": job.id, "object": kind, "created": job.created, "model": job.model_name, "choices": [choice]}


def usage(outcome) -> dict:
    return {"prompt_tokens": outcome.prompt_tokens, "completion_tokens": outcome.completion_tokens,
            "total_tokens": outcome.prompt_tokens + outcome.completion_tokens}


def response(job, outcome) -> dict:
    """The whole (non-streamed) response body."""
    choices = []
    for c in outcome.choices:
        if job.spec.endpoint == "chat":
            choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                            "logprobs": c.logprobs, "finish_reason": c.finish_reason})
        else:
            choices.append({"index": c.index, "text": c.text or "", "logprobs": c.logprobs,
                            "finish_reason": c.finish_reason})
    return {"id": job.id, "object": "chat.completion" if job.spec.endpoint == "chat" else "text_completion",
            "created": job.created, "model": job.model_name, "choices": choices, "usage": usage(outcome),
            "smc": outcome.smc}
