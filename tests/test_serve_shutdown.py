"""Graceful shutdown: SIGTERM with streaming clients mid-answer.

The server (free 127.0.0.1 port, ``--shutdown-timeout 3``, a prompt cache) has three
clients mid-answer when it gets SIGTERM: a short stream, which must finish whole; a
stream that cannot finish in time, which must end with an SSE error event and
``[DONE]``; a non-streaming request that cannot finish either, which must get a 503.
New connections are refused at once, the process exits 0, and the running requests'
prefixes are in the prompt cache's index afterwards.
"""
from __future__ import annotations

import json
import signal
import threading
import time

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from kvmetal.serve.server import ServerProcess  # noqa: E402
from kvmetal.serve.tiny import build_model_dir  # noqa: E402
from kvcases import free_port  # noqa: E402

BAN_END = {"logit_bias": {"0": -100}}  # <|end|> (token 0) never comes: answers run to max_tokens
OUTCOME: dict = {}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("tiny-llama-shutdown"))


class Stream(threading.Thread):
    """A streaming client that records every SSE data line; ``started`` once the first arrives."""

    def __init__(self, url, body):
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.lines, self.started, self.error = [], threading.Event(), None

    def run(self):
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=self.body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.lines.append(line[6:])
                        self.started.set()
        except httpx.HTTPError as e:
            self.error = e
        self.started.set()


def test_sigterm_mid_stream_drains_then_ends_the_rest_and_exits_0(model_dir, tmp_path):
    store = tmp_path / "prefixes"
    server = ServerProcess(model_dir, free_port(), "--log-level", "INFO", "--shutdown-timeout", "3",
                           "--prompt-cache-dir", store).start()
    long_prompt = "Summarize the following text in one sentence, keeping the numbers that matter most. " * 2
    short = Stream(server.url, {"prompt": "Write a short poem about the sea", "max_tokens": 24, "stream": True,
                                **BAN_END})
    long = Stream(server.url, {"prompt": long_prompt, "max_tokens": 1900, "stream": True, **BAN_END})
    whole = {}

    def non_streaming():
        whole["r"] = httpx.post(server.url + "/v1/completions", timeout=60,
                                json={"prompt": "Servers batch many requests", "max_tokens": 1900, **BAN_END})

    blocking = threading.Thread(target=non_streaming, daemon=True)
    try:
        long.start()
        assert long.started.wait(60) and long.error is None
        blocking.start()
        short.start()
        assert short.started.wait(60) and short.error is None
        time.sleep(0.2)  # the non-streaming request is in the engine too
        signalled = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.TransportError):  # no new connections
            httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=5)
        status = server.proc.wait(30)
        took = time.monotonic() - signalled
        for t in (short, long, blocking):
            t.join(30)
    finally:
        server.stop()
    assert status == 0, server.output[-3000:]
    assert 2.5 < took < 15, took  # waited for the running requests, up to --shutdown-timeout (3 s)
    # the short stream finished whole
    assert short.lines[-1] == "[DONE]" and short.error is None
    chunks = [json.loads(line) for line in short.lines[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and not any("error" in c for c in chunks)
    # the long stream was ended with an error event, then [DONE]
    assert long.lines[-1] == "[DONE]", long.lines[-3:]
    ended = json.loads(long.lines[-2])
    assert ended["error"]["type"] == "server_error" and "shutting down" in ended["error"]["message"]
    assert len(long.lines) > 5  # it was mid-answer
    # the non-streaming one got a 503 with an OpenAI-style body
    r = whole["r"]
    assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"], r.text
    # the running requests' full blocks (prompt and output so far) were saved
    [sub] = [p for p in store.iterdir() if p.is_dir()]
    entries = json.loads((sub / "index.json").read_text())["entries"]
    deepest = max(e["end"] for e in entries.values()) * 16
    long_tokens = len(long.lines) - 2  # chunks sent before the error event
    assert deepest > long_tokens, (deepest, long_tokens)
    assert "Traceback" not in server.output
    OUTCOME.update(exit_status=status, seconds_to_exit=round(took, 2), short_stream="finished whole (length)",
                   long_stream=f"{long_tokens} chunks, then error event: {ended['error']['message']!r}",
                   non_streaming=f"{r.status_code} {r.json()['error']['message']!r}",
                   deepest_saved_tokens=deepest)
    print("\nshutdown:", json.dumps(OUTCOME))
