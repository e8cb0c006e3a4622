"""The OpenAI-compatible server, end to end: the real server in a subprocess on a free port, the
default model on the CPU (reference backend), the official ``openai`` client.

Every request is small (a few tokens, 1-2 particles) so the whole file stays within a few minutes
on two cores."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import jsonschema
import openai
import pytest

from smcdecode.serve.metrics import parse as parse_metrics

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                             "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *args: str):
        self.port = _free_port()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "smcdecode", "serve", "--port", str(self.port), "--threads", "1", *args],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {self.output()}")
            try:
                if self.get("/health")[0] == 200:
                    break
            except OSError:
                time.sleep(0.3)
        else:
            raise RuntimeError(f"the server did not start: {self.output()}")
        self.model = self.get("/v1/models")[1]["data"][0]["id"]
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0,
                                    timeout=300)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()[-3000:]

    def request(self, method: str, path: str, body=None, raw: bytes | None = None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        try:
            data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
            conn.request(method, path, data, {"Content-Type": "application/json"})
            r = conn.getresponse()
            text = r.read().decode()
            try:
                return r.status, json.loads(text)
            except json.JSONDecodeError:
                return r.status, text
        finally:
            conn.close()

    def get(self, path: str):
        return self.request("GET", path)

    def post(self, path: str, body=None, raw: bytes | None = None):
        return self.request("POST", path, body, raw)

    def metrics(self) -> dict:
        status, text = self.get("/metrics")
        assert status == 200
        return parse_metrics(text)

    def wait_idle(self, timeout: float = 30) -> dict:
        deadline = time.time() + timeout
        while True:
            m = self.metrics()
            if m["smcdecode_queue_length"] == 0 and m["smcdecode_running"] == 0:
                return m
            if time.time() > deadline:
                raise AssertionError(f"the server is still busy after {timeout} s: {m}")
            time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        try:  # uvicorn shuts down, then re-raises the signal it caught
            assert self.proc.wait(timeout=30) in (0, -signal.SIGTERM), self.output()
        finally:
            self.log.close()


@pytest.fixture(scope="module")
def server():
    s = Server("--particles", "2", "--block-size", "2", "--max-queue", "64", "--default-max-tokens", "8")
    yield s
    s.stop()


def _chat(server, **kw):
    kw.setdefault("messages", QUESTION)
    kw.setdefault("temperature", 0.7)
    return server.client.chat.completions.create(model=server.model, **kw)


def _stream_text(stream) -> tuple[str, list[str], list, dict]:
    """(the concatenated text, the non-empty pieces, the finish reasons, the last chunk's extras)."""
    pieces, reasons, extra = [], [], {}
    for chunk in stream:
        if not chunk.choices:
            extra = {**chunk.model_extra, "usage": chunk.usage and chunk.usage.model_dump()}
            continue
        c = chunk.choices[0]
        text = c.delta.content if hasattr(c, "delta") else c.text
        if text:
            pieces.append(text)
        if c.finish_reason:
            reasons.append(c.finish_reason)
    return "".join(pieces), pieces, reasons, extra


def test_chat_models_health_and_the_smc_object(server):
    assert server.get("/health") == (200, {"status": "ok"})
    r = _chat(server, max_tokens=12, seed=0)
    c = r.choices[0]
    assert isinstance(c.message.content, str) and c.message.content
    assert c.finish_reason in ("stop", "length")
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert 0 < r.usage.completion_tokens <= 12
    smc = r.model_extra["smc"]
    assert smc["strategy"] == "smc" and smc["particles"] == 2 and smc["block_size"] == 2
    run = smc["runs"][0]
    assert run["log_evidence"] < 0 and 1 <= run["mean_ess"] <= 2 and run["rounds"] >= 1
    assert "particles" not in run
    r = _chat(server, max_tokens=6, seed=1, extra_body={"return_particles": True, "particles": 3})
    parts = r.model_extra["smc"]["runs"][0]["particles"]
    assert len(parts) == 3 and abs(sum(p["weight"] for p in parts) - 1) < 1e-9
    assert r.choices[0].message.content in [p["text"] for p in parts if p["weight"] > 0]


def test_seed_reproduces_the_library_run(server):
    import smcdecode as sd

    model = sd.load_model(threads=1)
    draft = sd.load_default_draft(model)
    ids = model.prompt_ids(QUESTION)
    smc = sd.SMC(sd.LM(model, temperature=0.7), sd.Draft(draft, 0.5), particles=2, block_size=2)
    expected = smc.run(ids, max_new_tokens=10, seed=5, progress=False).text
    got = [_chat(server, max_tokens=10, seed=5).choices[0].message.content for _ in range(2)]
    assert got == [expected, expected]
    ar = sd.Autoregressive(sd.LM(model, temperature=0.7)).run(ids, max_new_tokens=10, seed=9, progress=False)
    assert _chat(server, max_tokens=10, seed=9, extra_body={"strategy": "ar"}).choices[0].message.content == ar.text
    # a stop sequence cuts the same sample (the run stops once the cut text is final)
    assert " " in ar.text
    cut = _chat(server, max_tokens=10, seed=9, stop=" ", extra_body={"strategy": "ar"}).choices[0]
    assert (cut.message.content, cut.finish_reason) == (ar.text.split(" ")[0], "stop")


def test_completions_with_a_regex_and_logprobs(server):
    r = server.client.completions.create(model=server.model, prompt="The year was ", max_tokens=6, seed=0,
                                         extra_body={"regex": "[0-9]{2,4}"}, logprobs=2)
    c = r.choices[0]
    assert re.fullmatch("[0-9]{2,4}", c.text)
    lp = c.logprobs
    assert "".join(lp.tokens) == c.text and len(lp.token_logprobs) == len(lp.tokens)
    assert all(v < 0 for v in lp.token_logprobs) and all(len(t) == 2 for t in lp.top_logprobs)
    assert all(max(t.values()) >= v - 1e-9 for t, v in zip(lp.top_logprobs, lp.token_logprobs))
    r = _chat(server, max_tokens=4, seed=0, extra_body={"strategy": "ar", "regex": "(yes|no)"})
    assert r.choices[0].message.content in ("yes", "no")
    r = _chat(server, max_tokens=4, seed=0, extra_body={"regex": ""})  # as Regex(""): the empty text only
    assert r.choices[0].message.content == "" and r.choices[0].finish_reason == "stop"


def test_json_schema_and_json_object(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    messages = [{"role": "user", "content": "Describe a person."}]
    r = _chat(server, messages=messages, max_tokens=40, seed=0, response_format=fmt)
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    text, pieces, reasons, _ = _stream_text(_chat(server, messages=messages, max_tokens=40, seed=0,
                                                  response_format=fmt, stream=True))
    assert text == r.choices[0].message.content and reasons == [r.choices[0].finish_reason]
    r = _chat(server, messages=[{"role": "user", "content": "Describe a city as a JSON object."}], max_tokens=40,
              seed=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    # no document fits 3 tokens: no sample, and the fix is said in the request's own terms
    r = _chat(server, messages=messages, max_tokens=3, seed=0, response_format=fmt)
    message = r.model_extra["smc"]["runs"][0]["message"]
    assert r.choices[0].finish_reason == "length" and not r.choices[0].message.content
    assert "raise max_tokens or particles" in message and "max_new_tokens" not in message, message


@pytest.mark.parametrize("strategy", ["smc", "sd", "ar"])
def test_streaming_equals_the_whole_response(server, strategy):
    body = {"strategy": strategy}
    whole = _chat(server, max_tokens=14, seed=3, extra_body=body)
    text, pieces, reasons, extra = _stream_text(_chat(server, max_tokens=14, seed=3, extra_body=body, stream=True,
                                                      stream_options={"include_usage": True}))
    assert text == whole.choices[0].message.content
    assert reasons == [whole.choices[0].finish_reason]
    assert extra["usage"]["completion_tokens"] == whole.usage.completion_tokens > 0
    assert extra["smc"] == whole.model_extra["smc"]
    # text arrives as it becomes final, not all at the end
    assert len(pieces) >= (4 if strategy == "ar" else 2), pieces
    raw = server.client.completions.create(model=server.model, prompt="Once upon a time", max_tokens=8, seed=1,
                                           extra_body=body, stream=True)
    text, _, _, _ = _stream_text(raw)
    assert text == server.client.completions.create(model=server.model, prompt="Once upon a time", max_tokens=8,
                                                    seed=1, extra_body=body).choices[0].text


def test_stop_sequences_and_n(server):
    r = _chat(server, max_tokens=16, seed=0, n=2, stop=[" "], extra_body={"strategy": "ar"})
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert " " not in c.message.content
    text, _, reasons, _ = _stream_text(_chat(server, max_tokens=16, seed=0, stop=[" "], stream=True,
                                             extra_body={"strategy": "ar"}))
    assert text == r.choices[0].message.content and reasons == [r.choices[0].finish_reason]


BAD = [  # (endpoint, body or raw bytes, status, param)
    ("chat", b"{not json", 400, None),
    ("chat", {"model": "m"}, 400, "messages"),
    ("chat", {"messages": []}, 400, "messages"),
    ("chat", {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].role"),
    ("chat", {"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
    ("chat", {"messages": QUESTION, "temperature": 0}, 400, "temperature"),
    ("chat", {"messages": QUESTION, "temperature": "hot"}, 400, "temperature"),
    ("chat", {"messages": QUESTION, "n": 0}, 400, "n"),
    ("chat", {"messages": QUESTION, "max_tokens": -1}, 400, "max_tokens"),
    ("chat", {"messages": QUESTION, "max_tokens": 9000}, 400, "max_tokens"),
    ("chat", {"messages": QUESTION, "top_p": 0.5}, 400, "top_p"),
    ("chat", {"messages": QUESTION, "frobnicate": 1}, 400, "frobnicate"),
    ("chat", {"messages": QUESTION, "particles": 10**6}, 400, "particles"),
    ("chat", {"messages": QUESTION, "strategy": "beam"}, 400, "strategy"),
    ("chat", {"messages": QUESTION, "resampler": "best"}, 400, "resampler"),
    ("chat", {"messages": QUESTION, "ess_threshold": 2}, 400, "ess_threshold"),
    ("chat", {"messages": QUESTION, "regex": "("}, 400, "regex"),
    ("chat", {"messages": QUESTION, "strategy": "sd", "regex": "[a-z]+"}, 400, "regex"),
    ("chat", {"messages": QUESTION, "response_format": {"type": "xml"}}, 400, "response_format.type"),
    ("chat", {"messages": QUESTION, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nope"}}}}, 400, "response_format"),
    ("chat", {"messages": QUESTION, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("chat", {"messages": QUESTION, "seed": -1}, 400, "seed"),
    ("chat", {"messages": QUESTION, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("chat", {"messages": QUESTION, "model": "gpt-4"}, 404, "model"),
    ("chat", {"messages": [{"role": "user", "content": "hello " * 9000}]}, 400, "messages"),
    ("completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("completions", {"prompt": "Hi", "logprobs": 9}, 400, "logprobs"),
    ("completions", {"prompt": "Hi", "echo": True}, 400, "echo"),
    ("completions", {"prompt": [10**9, 3]}, 400, "prompt"),
]


def test_bad_requests_get_openai_errors_naming_the_field(server):
    for endpoint, body, status, param in BAD:
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        raw = body if isinstance(body, bytes) else None
        got, answer = server.post(path, None if raw else body, raw=raw)
        assert got == status, (body, answer)
        err = answer["error"]
        assert err["param"] == param and err["message"] and err["type"], (body, err)
    status, answer = server.get("/v1/chat/completions")
    assert status == 405 and answer["error"]["type"] == "invalid_request_error", answer
    assert server.get("/nowhere")[1]["error"]["message"]
    with pytest.raises(openai.BadRequestError) as e:  # the client sees the field too
        _chat(server, max_tokens=4, temperature=0)
    assert e.value.body["param"] == "temperature"
    m = server.metrics()
    assert m.get('smcdecode_requests_total{endpoint="chat",status="500"}', 0) == 0


def _hold(server, body, path="/v1/chat/completions") -> socket.socket:
    """Send a request and keep the connection open without reading the answer."""
    s = socket.create_connection(("127.0.0.1", server.port))
    data = json.dumps(body).encode()
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


LONG = {"messages": QUESTION, "max_tokens": 3000, "strategy": "ar", "temperature": 1.0}


def test_disconnect_frees_the_request_and_a_full_queue_is_429(server):
    before = server.wait_idle()
    # a running request whose client goes away stops at its next step
    s = _hold(server, LONG)
    deadline = time.time() + 30
    while server.metrics()["smcdecode_running"] == 0:
        assert time.time() < deadline
        time.sleep(0.05)
    s.close()
    t0 = time.time()
    m = server.wait_idle(timeout=15)
    assert time.time() - t0 < 15 and m["smcdecode_cancelled_total"] == before["smcdecode_cancelled_total"] + 1
    # the same for a stream the client stops reading
    stream = _chat(server, max_tokens=3000, extra_body={"strategy": "ar"}, stream=True)
    next(iter(stream))
    stream.close()
    m = server.wait_idle(timeout=15)
    assert m["smcdecode_cancelled_total"] == before["smcdecode_cancelled_total"] + 2
    # one running and 64 waiting fill the server: the next request gets 429; closing them empties it
    held = [_hold(server, LONG)]
    while server.metrics()["smcdecode_running"] == 0:
        time.sleep(0.05)
    held += [_hold(server, LONG) for _ in range(64)]
    deadline = time.time() + 30
    while server.metrics()["smcdecode_queue_length"] < 64:
        assert time.time() < deadline
        time.sleep(0.05)
    status, answer = server.post("/v1/chat/completions", {"messages": QUESTION, "max_tokens": 1})
    assert status == 429 and answer["error"]["code"] == "rate_limit_exceeded"
    with pytest.raises(openai.RateLimitError):
        _chat(server, max_tokens=1)
    for s in held:
        s.close()
    m = server.wait_idle(timeout=30)
    assert m["smcdecode_cancelled_total"] == before["smcdecode_cancelled_total"] + 67
    assert m["smcdecode_rejected_total"] == before["smcdecode_rejected_total"] + 2
    assert _chat(server, max_tokens=2, seed=0).choices[0].message.content  # still serving


def test_smc_requests_interleave_on_the_reference_loop(server):
    """A short SMC request joins the loop while a long one (4 choices of a story) runs, and leaves
    first; its answer is the one it gets alone (a request's draws do not depend on its company)."""
    before = server.wait_idle()
    story = [{"role": "user", "content": "Write a long story about a dragon and a knight."}]
    long = _hold(server, {"messages": story, "max_tokens": 3000, "temperature": 1.0, "n": 4, "particles": 2})
    deadline = time.time() + 30
    while server.metrics()["smcdecode_running"] == 0:
        assert time.time() < deadline
        time.sleep(0.05)
    shared = _chat(server, max_tokens=10, seed=5)
    assert server.metrics()["smcdecode_running"] == 1  # the long one still runs
    long.close()
    m = server.wait_idle(timeout=30)
    assert m["smcdecode_cancelled_total"] == before["smcdecode_cancelled_total"] + 1
    alone = _chat(server, max_tokens=10, seed=5)
    assert shared.choices[0].message.content == alone.choices[0].message.content
    assert shared.model_extra["smc"] == alone.model_extra["smc"]


def test_64_concurrent_clients_mixing_good_and_bad_requests(server):
    results: dict[int, object] = {}

    def client(i: int) -> None:
        kind = i % 8
        try:
            if kind == 0:
                _chat(server, max_tokens=2, temperature=-1)
                results[i] = "no error"
            elif kind == 1:
                results[i] = server.post("/v1/completions", {"prompt": "Hi", "best_of": 3})
            elif kind in (2, 3):
                strategy = ("smc", "sd", "ar")[i % 3]
                r = _chat(server, max_tokens=3, seed=i, extra_body={"strategy": strategy, "block_size": 1})
                results[i] = ("chat", r.choices[0].message.content, r.choices[0].finish_reason)
            elif kind == 4:
                r = _chat(server, max_tokens=3, seed=i, extra_body={"regex": "[a-z]+", "particles": 1})
                results[i] = ("regex", r.choices[0].message.content)
            elif kind == 5:
                text, *_ = _stream_text(_chat(server, max_tokens=3, seed=i, stream=True,
                                              extra_body={"strategy": "ar"}))
                results[i] = ("stream", text)
            elif kind == 6:
                r = server.client.completions.create(model=server.model, prompt="One, two,", max_tokens=2, seed=i,
                                                     extra_body={"strategy": "sd", "block_size": 1})
                results[i] = ("completion", r.choices[0].text)
            else:
                results[i] = server.post("/v1/chat/completions", {"messages": QUESTION, "n": 99})
        except openai.BadRequestError as e:
            results[i] = ("400", e.body["param"])
        except Exception as e:  # noqa: BLE001 - recorded, so a lost request fails the test below
            results[i] = ("exception", repr(e))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert sorted(results) == list(range(64))
    for i, r in results.items():
        kind = i % 8
        if kind == 0:
            assert r == ("400", "temperature"), r
        elif kind == 1:
            assert r[0] == 400 and r[1]["error"]["param"] == "best_of", r
        elif kind == 7:
            assert r[0] == 400 and r[1]["error"]["param"] == "n", r
        elif kind == 4:
            assert r[0] == "regex" and re.fullmatch("[a-z]+", r[1]), r
        else:
            assert r[0] in ("chat", "stream", "completion") and isinstance(r[1], str), r
    server.wait_idle()


def test_a_thousand_requests_leak_nothing(server):
    """1,000 requests through the whole path (HTTP, checks, queue, a run, the answer): one-token
    completions (one forward of the model), every tenth a 400, every fifth a stream, on two
    connections at once. From request 200 to request 1,000 the server's threads, file descriptors
    and memory do not grow (a leak per request would add hundreds)."""
    failures = []

    def client(first: int, last: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        for i in range(first, last, 2):
            body = {"prompt": "Hi", "max_tokens": 1, "seed": i, "strategy": "ar", "stream": i % 5 == 4}
            if i % 10 == 9:
                body["temperature"] = 0  # a 400
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            r = conn.getresponse()
            text = r.read().decode()
            if i % 10 == 9:
                ok = r.status == 400 and json.loads(text)["error"]["param"] == "temperature"
            elif body["stream"]:
                ok = r.status == 200 and text.endswith("data: [DONE]\n\n")
            else:
                ok = r.status == 200 and len(json.loads(text)["choices"]) == 1
            if not ok:
                failures.append((i, r.status, text[:200]))
        conn.close()

    def requests(first: int, last: int) -> dict:
        threads = [threading.Thread(target=client, args=(first + k, last)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=900)
        assert not failures, failures[:5]
        return server.wait_idle()

    start = requests(0, 200)  # (allocator pools, caches and worker threads warm up)
    end = requests(200, 1000)
    assert end["smcdecode_process_threads"] <= start["smcdecode_process_threads"] + 2
    assert end["smcdecode_process_open_fds"] <= start["smcdecode_process_open_fds"] + 2
    grew = end["smcdecode_process_resident_memory_bytes"] - start["smcdecode_process_resident_memory_bytes"]
    assert grew < 32 * 2**20, f"resident memory grew by {grew / 2**20:.1f} MiB over 800 requests"
    key = 'smcdecode_requests_total{endpoint="completions",status="200"}'
    assert end[key] - start[key] == 720


def test_metrics_report_the_work(server):
    m = server.metrics()
    for name in ("smcdecode_prompt_tokens_total", "smcdecode_completion_tokens_total", "smcdecode_rounds_total",
                 "smcdecode_mean_ess", "smcdecode_resampling_rate", "smcdecode_queue_length"):
        assert name in m
    assert m["smcdecode_rounds_total"] > 0 and 0 < m["smcdecode_mean_ess"] <= 1
    assert 0 <= m["smcdecode_resampling_rate"] <= 1
    assert m['smcdecode_requests_total{endpoint="chat",status="200"}'] > 0


def test_serve_without_the_extra_names_it():
    blocker = ("import sys, importlib.abc\n"
               "class Block(importlib.abc.MetaPathFinder):\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               "        if name.split('.')[0] in ('starlette', 'uvicorn'):\n"
               "            raise ImportError(name)\n"
               "sys.meta_path.insert(0, Block())\n"
               "from smcdecode.cli import main\n"
               "sys.exit(main(['serve']))\n")
    p = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "smcdecode[serve]" in p.stderr and "starlette" in p.stderr
    help_text = subprocess.run([sys.executable, "-m", "smcdecode", "serve", "--help"], capture_output=True,
                               text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120).stdout
    for flag in ("--model", "--draft", "--backend", "--device", "--host", "--port", "--max-queue", "--max-particles"):
        assert flag in help_text


def test_the_startup_line_says_what_serves(server):
    server.log.seek(0)
    first = next(line for line in server.log.read().splitlines() if line.startswith("smcdecode serve:"))
    assert first == (f"smcdecode serve: {server.model} (the reference backend on cpu (float32), draft default) "
                     f"on http://127.0.0.1:{server.port}/v1"), first


def test_a_port_in_use_is_refused_before_the_model_loads(capsys):
    from smcdecode.serve.cli import main as serve

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        started = time.perf_counter()
        assert serve(["--port", str(port), "--host", "127.0.0.1"]) == 2
    err = capsys.readouterr().err
    assert f"--port {port}: cannot listen on 127.0.0.1:{port}" in err and "give another --port" in err, err
    assert time.perf_counter() - started < 5  # (no model was loaded)
