"""Clients that misbehave on purpose; each test asserts the server keeps serving the others.

One server on a free 127.0.0.1 port for the module (stopped at the end, exit 0 asserted);
every loop is bounded in count and time. ``CASES`` collects each case's answer, which
the last test prints as a table (``pytest -s`` shows it).
"""
from __future__ import annotations

import json
import socket
import threading
import time

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from kvmetal.serve import metrics  # noqa: E402
from kvmetal.serve.server import ServerProcess  # noqa: E402
from kvmetal.serve.tiny import build_model_dir  # noqa: E402
from kvcases import free_port  # noqa: E402

CASES: dict = {}  # case -> the server's answer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("tiny-llama-hostile"))


@pytest.fixture(scope="module")
def server(model_dir):
    s = ServerProcess(model_dir, free_port(), "--log-level", "WARNING").start()
    s.model = str(model_dir)
    yield s
    assert s.stop() == 0, s.output


def normal(server, max_tokens=6) -> dict:
    """A well-behaved request: it must still get a whole answer."""
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "The paged cache keeps keys",
                                                         "max_tokens": max_tokens}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    return body


def raw_post(server, body: bytes, path="/v1/completions") -> httpx.Response:
    return httpx.post(server.url + path, content=body, headers={"content-type": "application/json"}, timeout=60)


def error_of(r, status) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    error = r.json()["error"]
    assert error["message"] and error["type"]
    return error


def test_many_idle_connections_do_not_stop_others(server):
    host, port = "127.0.0.1", int(server.url.rsplit(":", 1)[1])
    idle = []
    try:
        for _ in range(300):
            idle.append(socket.create_connection((host, port), timeout=10))
        started = time.monotonic()
        normal(server)
        took = time.monotonic() - started
        # uvicorn's keep-alive timeout (5 s) also applies to a connection that never sent a byte
        idle[0].settimeout(30)
        closed = idle[0].recv(1) == b""
    finally:
        for s in idle:
            s.close()
    assert closed
    CASES["300 idle connections"] = (f"others served meanwhile ({took:.2f} s for one request); "
                                     f"idle ones closed by the server after 5 s")


def test_a_very_slow_stream_reader_blocks_neither_the_engine_nor_other_streams(server):
    body = json.dumps({"prompt": "Write a short poem about the sea", "max_tokens": 400, "stream": True,
                       "logit_bias": {"0": -100}}).encode()
    port = int(server.url.rsplit(":", 1)[1])
    before = metrics.parse(httpx.get(server.url + "/metrics").text)
    slow = socket.socket()
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # tiny window: the server's writes back up
    slow.connect(("127.0.0.1", port))
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    try:
        slow.settimeout(30)
        assert slow.recv(64)  # the stream began
        started = time.monotonic()
        streamed = []
        for _ in range(3):  # other clients, streaming, while the slow one reads nothing
            with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                              json={"prompt": "Servers batch many requests", "max_tokens": 12, "stream": True}) as r:
                streamed.append([line for line in r.iter_lines() if line.startswith("data: ")][-1])
        took = time.monotonic() - started
        after = metrics.parse(httpx.get(server.url + "/metrics").text)
        assert streamed == ["data: [DONE]"] * 3
        # the engine finished the slow client's 400 tokens without waiting for it to read them
        deadline = time.monotonic() + 30
        while after["kvmetal_requests_running"] > 0:
            assert time.monotonic() < deadline, after
            time.sleep(0.1)
            after = metrics.parse(httpx.get(server.url + "/metrics").text)
        assert after["kvmetal_generated_tokens"] - before["kvmetal_generated_tokens"] >= 400 + 3
        assert after['kvmetal_requests_finished{reason="length"}'] > before['kvmetal_requests_finished{reason="length"}']
        got = 0
        slow.settimeout(0.2)
        for _ in range(5):  # it can still read (slowly) what it was sent
            try:
                got += len(slow.recv(512))
            except socket.timeout:
                pass
        assert got > 0
    finally:
        slow.close()
    normal(server)
    CASES["stream read at ~0 B/s (4 KiB window)"] = (f"3 other streams done in {took:.2f} s; the engine generated "
                                                      f"all 400 tokens meanwhile (buffered for the reader)")


def test_a_10_mb_body_gets_413(server):
    body = json.dumps({"prompt": "x" * (10 * 2**20), "max_tokens": 1}).encode()
    result = {}

    def send():
        result["r"] = raw_post(server, body)

    t = threading.Thread(target=send)
    t.start()
    normal(server)  # served while the big body is refused
    t.join(60)
    error = error_of(result["r"], 413)
    assert "body limit" in error["message"]
    normal(server)
    CASES["10 MB body"] = f"413 {error['code']}: {error['message'][:60]}..."


def test_deeply_nested_json_gets_400(server):
    for body in (b"[" * 200_000 + b"]" * 200_000, b'{"prompt": "hi", "x": ' + b"{\"a\":" * 50_000 + b"1" +
                 b"}" * 50_000 + b"}"):
        error = error_of(raw_post(server, body), 400)
        assert "nested too deeply" in error["message"] or "not valid JSON" in error["message"], error
    normal(server)
    CASES["JSON nested 200,000 deep"] = f"400: {error['message']}"


def test_invalid_utf8_gets_400(server):
    bodies = [b'{"prompt": "caf\xc3\x28", "max_tokens": 2}', b"\xff\xfe\x00{",
              b'{"prompt": "\\ud800 lone surrogate", "max_tokens": 2}']
    answers = []
    for body in bodies:
        answers.append(error_of(raw_post(server, body), 400)["message"])
    chat = b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}'
    answers.append(error_of(raw_post(server, chat, "/v1/chat/completions"), 400)["message"])
    normal(server)
    CASES["invalid UTF-8 / lone surrogates"] = "400: " + answers[0][:60] + "... / " + answers[2][:40] + "..."


def test_a_prompt_of_control_characters_is_served(server):
    control = "".join(chr(c) for c in range(32)) * 8 + "\x7f\u200b\u2028\ufeff"
    r = httpx.post(server.url + "/v1/completions", json={"prompt": control, "max_tokens": 8}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    c = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": control}], "max_tokens": 8, "stream": True})
    assert c.status_code == 200 and c.text.rstrip().endswith("data: [DONE]")
    normal(server)
    CASES["prompt of control characters (NUL..US, DEL, U+2028...)"] = (
        f"200, answered ({r.json()['usage']['prompt_tokens']} prompt tokens); chat streamed too")


def test_zz_table(server):
    m = metrics.parse(httpx.get(server.url + "/metrics").text)
    assert m["kvmetal_requests_running"] == 0 and m["kvmetal_kv_blocks_owned"] == 0
    print("\n| hostile client | the server's answer (others kept being served) |\n|---|---|")
    for case, answer in CASES.items():
        print(f"| {case} | {answer} |")
