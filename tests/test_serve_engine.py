"""The server on the engine's continuous-batching scheduler (``--backend engine``), run on the
CPU through the engine's torch path with the default model: the same HTTP layer, another executor."""

from __future__ import annotations

import threading
import time

import pytest
from test_serve import QUESTION, Server, _stream_text

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine_server():
    s = Server("--backend", "engine", "--device", "cpu", "--slots", "2", "--engine-particles", "2",
               "--engine-context", "256", "--particles", "2", "--block-size", "2", "--max-block-size", "2")
    yield s
    s.stop()


def _chat(server, **kw):
    return server.client.chat.completions.create(model=server.model, messages=QUESTION, temperature=0.7, **kw)


def test_batched_requests_stream_exactly_and_mix_strategies(engine_server):
    s = engine_server
    text, pieces, reasons, extra = _stream_text(_chat(s, max_tokens=12, stream=True,
                                                      extra_body={"return_particles": True}))
    particles = extra["smc"]["runs"][0]["particles"]
    assert text in [p["text"] for p in particles if p["weight"] > 0]
    assert reasons[0] in ("stop", "length") and len(pieces) >= 1
    answers: dict[int, object] = {}

    def client(i: int) -> None:
        strategy = ("smc", "smc", "sd", "ar", "smc")[i]
        r = _chat(s, max_tokens=6, n=2 if i == 4 else 1, extra_body={"strategy": strategy})
        answers[i] = (strategy, [c.message.content for c in r.choices], r.model_extra["smc"])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert sorted(answers) == list(range(5))
    for strategy, texts, smc in answers.values():
        assert smc["strategy"] == strategy and all(isinstance(t, str) and t for t in texts)
    assert len(answers[4][1]) == 2
    m = s.wait_idle()
    assert m["smcdecode_kv_pages_in_use"] == 0 and m["smcdecode_rounds_total"] > 0  # every page is free again


def test_speculative_decoding_streams_from_the_request_loop(engine_server):
    """Plain sd runs as a program of the request loop (exact speculative decoding rows): its text
    arrives round by round, not at the end, and its acceptance is reported."""
    s = engine_server
    text, pieces, reasons, extra = _stream_text(_chat(s, max_tokens=24, stream=True, extra_body={"strategy": "sd"}))
    assert extra["smc"]["strategy"] == "sd" and text and reasons[0] in ("stop", "length")
    assert len(pieces) >= 3  # (a batch run to its end arrives as one piece)
    assert s.wait_idle()["smcdecode_kv_pages_in_use"] == 0


@pytest.mark.parametrize("strategy", ["smc", "ar", "sd"])
def test_a_disconnect_frees_the_scheduler_slot(engine_server, strategy):
    s = engine_server
    before = s.wait_idle()
    stream = _chat(s, max_tokens=200, stream=True, extra_body={"strategy": strategy})
    next(iter(stream))
    deadline = time.time() + 60
    while s.metrics()["smcdecode_kv_pages_in_use"] == 0:
        assert time.time() < deadline
        time.sleep(0.05)
    stream.close()
    m = s.wait_idle(timeout=30)
    assert m["smcdecode_cancelled_total"] == before["smcdecode_cancelled_total"] + 1
    assert m["smcdecode_kv_pages_in_use"] == 0
    assert _chat(s, max_tokens=2).choices[0].message.content  # still serving
