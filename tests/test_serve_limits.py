"""``kvmetal serve`` limits and auth: --api-key, the body limit, --max-queue and
--max-prompt-tokens (429 + Retry-After), --timeout, and the bind warning.

Servers listen on free 127.0.0.1 ports and are stopped by the test (or module) that
started them; every request loop is bounded in count and time.
"""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from kvmetal.serve import metrics  # noqa: E402
from kvmetal.serve.server import ServerProcess  # noqa: E402
from kvmetal.serve.tiny import build_model_dir  # noqa: E402
from kvcases import free_port  # noqa: E402

KEY = "sk-test-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("tiny-llama-limits"))


@pytest.fixture(scope="module")
def guarded(model_dir):
    """A server with a key, a 64 KiB body limit, a queue of 2, 200 queued prompt tokens,
    and a 16-token step budget (so concurrent requests really queue)."""
    server = ServerProcess(model_dir, free_port(), "--log-level", "WARNING", "--api-key", KEY,
                           "--max-body-bytes", str(BODY_LIMIT), "--max-queue", "2", "--max-prompt-tokens", "200",
                           "--max-num-batched-tokens", "16").start()
    server.model = str(model_dir)
    yield server
    assert server.stop() == 0, server.output


def post(server, path, body, headers=AUTH, **kw):
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, headers={"content-type": "application/json", **headers},
                      timeout=60, **kw)


def completion(server, prompt="The paged cache keeps keys", max_tokens=4, **extra):
    r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, **extra})
    return r


def read_metrics(server) -> dict:
    return metrics.parse(httpx.get(server.url + "/metrics", headers=AUTH, timeout=10).text)


def assert_openai_error(r, status):
    assert r.status_code == status, (r.status_code, r.text)
    error = r.json()["error"]
    assert isinstance(error["message"], str) and error["message"] and error["type"], error
    return error


def test_api_key_guards_every_route_but_health(guarded):
    assert httpx.get(guarded.url + "/health").json() == {"status": "ok"}
    wrong = [{}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}]
    for headers in wrong:
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"),
                             ("POST", "/v1/chat/completions"), ("GET", "/v1/nothing")):
            r = httpx.request(method, guarded.url + path, headers=headers, json={"prompt": "hi", "max_tokens": 1},
                              timeout=30)
            error = assert_openai_error(r, 401)
            assert error["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer", (path, headers)
    assert httpx.get(guarded.url + "/v1/models", headers=AUTH).status_code == 200
    r = completion(guarded)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert post(guarded, "/v1/nothing", {}).status_code == 404  # past the key, routes as before
    assert read_metrics(guarded)['kvmetal_http_rejected{status="401"}'] >= 20


def test_the_key_can_come_from_the_environment(monkeypatch):
    from kvmetal.serve.cli import parse_args
    from kvmetal.serve.server import api_key, is_loopback

    monkeypatch.delenv("KVMETAL_API_KEY", raising=False)
    assert api_key(parse_args(["--model", "m"])) is None
    monkeypatch.setenv("KVMETAL_API_KEY", "from-env")
    assert api_key(parse_args(["--model", "m"])) == "from-env"
    assert api_key(parse_args(["--model", "m", "--api-key", "flag"])) == "flag"
    assert parse_args(["--model", "m"]).host == "127.0.0.1"  # the default bind stays on this machine
    assert all(is_loopback(h) for h in ("127.0.0.1", "::1", "localhost", "127.0.0.2"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "192.168.1.4", "::", "example.com"))


def test_a_body_over_the_limit_gets_413_declared_or_chunked(guarded):
    big = json.dumps({"prompt": "x" * (BODY_LIMIT + 10), "max_tokens": 1})
    error = assert_openai_error(post(guarded, "/v1/completions", big), 413)
    assert "body limit" in error["message"] and str(BODY_LIMIT) in error["message"]

    def chunks():  # no Content-Length: the limit is found while reading
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"y" * 4096
        yield b'", "max_tokens": 1}'

    r = httpx.post(guarded.url + "/v1/completions", content=chunks(), timeout=60,
                   headers={"content-type": "application/json", **AUTH})
    assert_openai_error(r, 413)
    assert completion(guarded).status_code == 200  # still serving
    small = {"prompt": "hi", "max_tokens": 1, "padding": "x" * (BODY_LIMIT // 2)}  # under the limit: served
    assert post(guarded, "/v1/completions", small).status_code == 200


def test_a_full_queue_gets_429_with_retry_after(guarded):
    # 12 short prompts at once, one admitted per step, a queue of 2: some must be refused
    prompts = [f"Servers batch many requests {i}" for i in range(12)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: completion(guarded, p, max_tokens=4), prompts))
    statuses = [r.status_code for r in answers]
    assert set(statuses) <= {200, 429}, statuses
    refused = [r for r in answers if r.status_code == 429]
    assert refused and statuses.count(200) >= 2, statuses
    for r in refused:
        error = assert_openai_error(r, 429)
        assert error["type"] == "rate_limit_error" and "--max-queue" in error["message"], error
        assert int(r.headers["retry-after"]) >= 1
    assert completion(guarded).status_code == 200


def test_queued_prompt_tokens_past_max_prompt_tokens_get_429_and_one_too_long_prompt_400(guarded):
    long_prompt = "The paged cache keeps keys and values in fixed blocks " * 4  # ~ 40-90 tokens
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: completion(guarded, long_prompt + str(i), max_tokens=2), range(8)))
    refused = [r for r in answers if r.status_code == 429]
    assert {r.status_code for r in answers} <= {200, 429} and refused
    assert any("--max-prompt-tokens" in r.json()["error"]["message"] or "--max-queue" in r.json()["error"]["message"]
               for r in refused)
    assert all(int(r.headers["retry-after"]) >= 1 for r in refused)
    error = assert_openai_error(completion(guarded, "The paged cache " * 150), 400)  # alone over 200 tokens
    assert "--max-prompt-tokens" in error["message"]
    assert completion(guarded).status_code == 200


def test_timeout_ends_the_request_and_frees_its_blocks(model_dir):
    server = ServerProcess(model_dir, free_port(), "--log-level", "WARNING", "--timeout", "1.5").start()
    try:
        ban_end = {"logit_bias": {"0": -100}}  # <|end|> is token 0: the answer can only run long
        started = time.monotonic()
        r = completion(server, max_tokens=1900, **ban_end)
        took = time.monotonic() - started
        error = assert_openai_error(r, 504)
        assert error["type"] == "timeout_error" and "--timeout" in error["message"]
        assert took < 20
        body = {"prompt": "Write a short poem about the sea", "max_tokens": 1900, "stream": True, **ban_end}
        events = []
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as s:
            assert s.status_code == 200
            events = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        last = json.loads(events[-2][len("data: "):])
        assert last["error"]["type"] == "timeout_error", last
        assert len(events) > 3  # tokens came before the deadline
        deadline = time.monotonic() + 20
        while True:
            m = metrics.parse(httpx.get(server.url + "/metrics").text)
            if m["kvmetal_kv_blocks_owned"] == 0 and m["kvmetal_requests_running"] == 0:
                break
            assert time.monotonic() < deadline, m
            time.sleep(0.05)
        assert m['kvmetal_requests_finished{reason="timeout"}'] == 2 and m["kvmetal_kv_used_bytes"] == 0
        assert completion(server).status_code == 200  # short requests still finish
    finally:
        assert server.stop() == 0, server.output


def test_binding_beyond_loopback_without_a_key_warns():
    # (tests only listen on 127.0.0.1, so the rule is checked where run() takes it from)
    from kvmetal.serve.server import bind_warning

    assert "without an API key" in bind_warning("0.0.0.0", None)
    assert "without an API key" in bind_warning("10.1.2.3", "")
    assert bind_warning("0.0.0.0", KEY) is None and bind_warning("127.0.0.1", None) is None
    assert bind_warning("localhost", None) is None and bind_warning("::1", None) is None
