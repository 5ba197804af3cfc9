"""``kvmetal serve`` with the official ``openai`` client against a real model directory.

The model is a random-weight llama (head_dim 64) saved with mlx-lm's utilities, with a
byte-level BPE tokenizer trained offline and a chat template. Servers run on free
127.0.0.1 ports; every test stops what it starts.
"""
from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from kvmetal.serve import metrics  # noqa: E402
from kvmetal.serve.memory import blocks_under_cap, model_pool_bytes, parse_memory  # noqa: E402
from kvmetal.serve.server import ServerProcess  # noqa: E402
from kvmetal.serve.tiny import build_model_dir  # noqa: E402

from kvcases import free_port, kv_layout_model  # noqa: E402

BLOCK_BYTES = 2 * 2 * 2 * 16 * 64 * 4  # layers * (K, V) * kv heads * block tokens * head_dim * float32
CAP_BLOCKS = 12
SYSTEM = ("You are a helpful assistant. Answer the question briefly and say when you do not know. "
          "The paged cache keeps keys and values in fixed blocks.")
QUESTIONS = ["What is the capital of France?", "Write a short poem about the sea.",
             "Summarize the following text in one sentence.", "Why are blocks shared?",
             "What happens when the pool runs out?", "How many bits do values keep?",
             "Servers batch many requests.", "Say something about Lyon.", "Quantized keys keep eight bits.",
             "A block table maps every sequence."]


def test_the_kv_format_is_read_as_generate_reads_it():
    from types import SimpleNamespace

    from kvmetal import KVFormat
    from kvmetal.kv_format import default_group_size
    from kvmetal.serve.server import _kv_format

    model = kv_layout_model()  # head_dim 64
    flags = dict(kv_bits=None, k_bits=None, v_bits=None, kv_group_size=None, k_group_size=None, v_group_size=None)
    read = lambda **kw: _kv_format(SimpleNamespace(**{**flags, **kw}), model)
    assert read(kv_bits=8).k_group_size == default_group_size(64) == 32
    assert read(kv_bits=4, k_bits=8) == KVFormat(k_bits=8, v_bits=4, k_group_size=32, v_group_size=32)
    assert read(k_bits=8, kv_group_size=64).k_group_size == 64
    assert read() == KVFormat()
    with pytest.raises(ValueError, match="--kv-group-size 128 does not divide the model's head_dim 64"):
        read(kv_bits=8, kv_group_size=128)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("tiny-llama"))


def serve(model_dir, *extra) -> ServerProcess:
    """``kvmetal serve`` in its own process (the engine runs on that process' main thread)."""
    server = ServerProcess(model_dir, free_port(), "--log-level", "WARNING", *extra).start()
    server.model = str(model_dir)
    return server


def stop(server) -> None:
    status = server.stop()
    assert status == 0, server.output


@pytest.fixture(scope="module")
def capped(model_dir):
    """A server whose KV cap holds CAP_BLOCKS blocks in all: concurrent requests must wait and preempt."""
    server = serve(model_dir, "--kv-memory", f"{CAP_BLOCKS * BLOCK_BYTES}B")
    yield server
    stop(server)


def client(server) -> "openai.OpenAI":
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def read_metrics(server) -> dict:
    return metrics.parse(httpx.get(server.url + "/metrics").text)


def wait_idle(server, timeout=20) -> dict:
    """Metrics once nothing runs and no KV block is owned (aborts are applied at the next step)."""
    deadline = time.monotonic() + timeout
    while True:
        m = read_metrics(server)
        if m["kvmetal_requests_running"] == 0 and m["kvmetal_kv_used_bytes"] == 0:
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.02)


def chat(server, question, **kw):
    kw.setdefault("max_tokens", 24)
    return client(server).chat.completions.create(
        model=server.model, messages=[{"role": "system", "content": SYSTEM},
                                                {"role": "user", "content": question}], **kw)


def mlx_lm_greedy_text(model_dir, prompt_ids, max_tokens, *, completion=False):
    """mlx-lm's own generation (its own KVCache, no kvmetal) of the same prompt. A chat answer
    is its streamed text (the first token's leading space trimmed, as mlx_lm.server answers);
    a completion is every token decoded, leading space kept, as OpenAI's /v1/completions."""
    from mlx_lm import load, stream_generate

    model, tokenizer = load(str(model_dir))
    results = list(stream_generate(model, tokenizer, prompt_ids, max_tokens=max_tokens))
    if completion:
        return tokenizer.decode([r.token for r in results])
    return "".join(r.text for r in results)


# ---------------------------------------------------------------------------- units


def test_kv_memory_parsing_and_pool_size():
    assert parse_memory("8GB") == 8 * 10**9 and parse_memory("512MiB") == 512 * 2**20
    assert parse_memory("1.5 GiB") == int(1.5 * 2**30) and parse_memory("393216B") == 393216
    assert 0 < parse_memory("0.25") < parse_memory("0.5")
    for bad in ("", "8 parsecs", "-1GB", "0", "GB"):
        with pytest.raises(ValueError, match=r"kv-memory"):
            parse_memory(bad)
    measure = {bits: (lambda n, b=bits: model_pool_bytes(kv_layout_model(), n, block_size=16, k_bits=b, v_bits=b))
               for bits in (None, 8, 4)}
    assert measure[None](2) - measure[None](1) == BLOCK_BYTES
    for cap, bits in ((10 * BLOCK_BYTES + 5, None), (10 * BLOCK_BYTES, 8), (3 * BLOCK_BYTES, 4)):
        n = blocks_under_cap(measure[bits], cap, block_size=16)
        assert measure[bits](n) <= cap < measure[bits](n + 1)  # the whole pool under the cap, no block left out
    assert blocks_under_cap(measure[8], 10 * BLOCK_BYTES, block_size=16) > 30  # K8 is smaller than float32
    with pytest.raises(ValueError, match=r"hold no block"):
        blocks_under_cap(measure[None], BLOCK_BYTES - 1, block_size=16)


# ---------------------------------------------------------------------------- the server


def test_openai_client_completions_and_chat_streaming_and_not(capped, model_dir):
    c = client(capped)
    model = str(model_dir)
    assert [m.id for m in c.models.list().data] == [model_dir.name]  # the model's name; its path is accepted too
    assert httpx.get(capped.url + "/health").json() == {"status": "ok"}

    prompt = "The paged cache keeps keys and values"
    whole = c.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
    streamed = list(c.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True))
    assert whole.choices[0].text == "".join(ch.choices[0].text for ch in streamed)
    assert whole.choices[0].finish_reason == streamed[-1].choices[0].finish_reason
    assert whole.usage.completion_tokens <= 12 and whole.usage.prompt_tokens > 5
    from mlx_lm import load

    _, tokenizer = load(str(model_dir))
    ids = tokenizer.encode(prompt)
    assert whole.choices[0].text == mlx_lm_greedy_text(model_dir, ids, 12, completion=True), \
        "greedy output differs from mlx-lm"

    answer = chat(capped, QUESTIONS[0])
    stream = list(chat(capped, QUESTIONS[0], stream=True, stream_options={"include_usage": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    assert answer.choices[0].message.content == "".join(ch.choices[0].delta.content or "" for ch in stream
                                                        if ch.choices)
    assert stream[-1].usage.completion_tokens == answer.usage.completion_tokens
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    chat_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert answer.usage.prompt_tokens == len(chat_ids)  # the tokenizer's chat template was applied
    assert answer.choices[0].message.content == mlx_lm_greedy_text(model_dir, chat_ids, 24)


def test_a_completion_keeps_its_first_tokens_leading_space(capped, model_dir):
    """The BPE detokenizer trims a first token's space (right for chat); a completion's text
    continues the prompt, so it keeps it, streamed or not, and its logprob tokens spell it."""
    from mlx_lm import load

    from kvmetal.serve.app import TextStream

    _, tokenizer = load(str(model_dir))
    ids = tokenizer.encode(" keys and values", add_special_tokens=False)
    assert tokenizer.decode(ids[:1]).startswith(" ")
    for keep, expected in ((True, " keys and values"), (False, "keys and values")):
        stream = TextStream(tokenizer, [], keep_leading_space=keep)
        offsets = [stream.add(t) for t in ids]
        assert offsets[0] == 0
        assert stream.take() + stream.take(final=True) == expected

    # A prompt whose greedy continuation (random weights) starts with a spaced token.
    c = client(capped)
    kw = dict(model=str(model_dir), max_tokens=8, temperature=0, logprobs=0)
    spaced = [p for p in QUESTIONS + [SYSTEM] if mlx_lm_greedy_text(
        model_dir, tokenizer.encode(p), 1, completion=True).startswith(" ")]
    assert spaced, "no prompt's greedy continuation starts with a space: pick other prompts"
    whole = c.completions.create(prompt=spaced[0], **kw)
    streamed = list(c.completions.create(prompt=spaced[0], stream=True, **kw))
    text = whole.choices[0].text
    assert text.startswith(" ")
    assert text == "".join(ch.choices[0].text for ch in streamed)
    assert text == "".join(whole.choices[0].logprobs.tokens)
    assert text == mlx_lm_greedy_text(model_dir, tokenizer.encode(spaced[0]), 8, completion=True)
    assert whole.choices[0].logprobs.text_offset[0] == 0


def test_seeded_sampling_is_reproducible(capped):
    a = chat(capped, QUESTIONS[1], temperature=0.9, top_p=0.95, seed=7).choices[0].message.content
    b = chat(capped, QUESTIONS[1], temperature=0.9, top_p=0.95, seed=7).choices[0].message.content
    others = {chat(capped, QUESTIONS[1], temperature=0.9, top_p=0.95, seed=s).choices[0].message.content
              for s in (8, 9, 10)}
    assert a == b and others - {a}


def test_concurrent_clients_match_alone_and_kv_stays_under_the_cap(capped):
    # 10 clients at once in a pool of 12 blocks: requests wait and running ones are preempted.
    cap = CAP_BLOCKS * BLOCK_BYTES
    jobs = [dict(question=q, max_tokens=16 + 4 * (i % 4), **({"temperature": 0.8, "seed": i} if i % 3 == 0 else {}))
            for i, q in enumerate(QUESTIONS)]
    run = lambda job: chat(capped, job["question"], **{k: v for k, v in job.items() if k != "question"})  # noqa
    alone = [run(job).choices[0].message.content for job in jobs]
    before = wait_idle(capped)
    samples, done = [], threading.Event()

    def poll():
        while not done.is_set():
            samples.append(read_metrics(capped))
            time.sleep(0.005)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        with ThreadPoolExecutor(len(jobs)) as pool:
            together = [r.choices[0].message.content for r in pool.map(run, jobs)]
    finally:
        done.set()
        poller.join()
    after = wait_idle(capped)
    assert together == alone
    assert after["kvmetal_preemptions"] > before["kvmetal_preemptions"], "the cap was meant to force preemption"
    assert max(s["kvmetal_requests_waiting"] for s in samples) > 0
    assert max(s["kvmetal_kv_used_bytes"] for s in samples) > 0
    assert all(s["kvmetal_kv_used_bytes"] <= cap and s["kvmetal_kv_pool_bytes"] <= cap for s in samples)
    assert after["kvmetal_kv_peak_used_bytes"] <= cap and after["kvmetal_kv_cap_bytes"] == cap
    assert after["kvmetal_ranks"] == 1
    # the shared system prompt was found in the prefix cache
    assert after["kvmetal_prompt_tokens_cached"] > before["kvmetal_prompt_tokens_cached"]


def test_the_next_turn_of_a_chat_reuses_the_blocks_of_the_last(capped):
    c = client(capped)
    turn = [{"role": "user", "content": "Tell me about the paged cache and how blocks are shared between requests."}]
    first = c.chat.completions.create(model=capped.model, messages=turn, max_tokens=40)
    turn += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And quantized keys?"}]
    second = c.chat.completions.create(model=capped.model, messages=turn, max_tokens=8)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # at least the first turn's full prompt blocks come from the cache, not the model
    assert second.usage.prompt_tokens_details.cached_tokens >= 16 * (first.usage.prompt_tokens // 16) > 0


def test_cached_tokens_are_reported_when_the_first_token_ends_the_request(capped):
    # regression: the engine forgets a finished request, so a one-token request reported 0 cached
    c = client(capped)
    prompt = "The paged cache shares whole blocks of a prompt prefix between requests that start alike, " * 2
    first = c.completions.create(model=capped.model, prompt=prompt, max_tokens=4)
    assert first.usage.prompt_tokens >= 32
    again = c.completions.create(model=capped.model, prompt=prompt, max_tokens=1)
    assert again.usage.completion_tokens == 1
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(capped, model_dir):
    post = lambda path, body: httpx.post(capped.url + path, content=body,  # noqa: E731
                                         headers={"content-type": "application/json"})
    cases = [
        ("/v1/completions", b"{not json", 400, None),
        ("/v1/completions", b"[1, 2]", 400, None),
        ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": -3}), 400, "max_tokens"),
        ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": True}), 400, "max_tokens"),
        ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 10**12}), 400, "max_tokens"),
        ("/v1/completions", json.dumps({"prompt": "hi", "temperature": "hot"}), 400, "temperature"),
        ("/v1/completions", json.dumps({"prompt": "hi", "stop": 5}), 400, "stop"),
        ("/v1/completions", json.dumps({"prompt": "hi", "logprobs": 50}), 400, "logprobs"),
        ("/v1/completions", json.dumps({"prompt": "hi", "top_logprobs": "3"}), 400, "top_logprobs"),
        ("/v1/completions", json.dumps({"prompt": "hi", "logit_bias": {"x": 1}}), 400, "logit_bias"),
        ("/v1/completions", json.dumps({"prompt": "hi", "logit_bias": [1]}), 400, "logit_bias"),
        ("/v1/completions", json.dumps({"prompt": "hi", "repetition_penalty": -1}), 400, "repetition_penalty"),
        ("/v1/completions", json.dumps({"prompt": "hi", "presence_penalty": "x"}), 400, "presence_penalty"),
        ("/v1/completions", json.dumps({"prompt": "hi", "frequency_context_size": 1.5}), 400,
         "frequency_context_size"),
        ("/v1/completions", json.dumps({"prompt": "hi", "xtc_threshold": 0.9}), 400, "xtc_threshold"),
        ("/v1/completions", json.dumps({"prompt": "hi", "n": 2}), 400, "n"),
        ("/v1/completions", json.dumps({"prompt": "hi", "priority": 1.5}), 400, "priority"),
        # seed: what mx.random.seed takes (0 to 2**64 - 1), at any temperature (issue 44)
        ("/v1/completions", json.dumps({"prompt": "hi", "seed": -1}), 400, "seed"),
        ("/v1/completions", json.dumps({"prompt": "hi", "seed": -1, "temperature": 0.7}), 400, "seed"),
        ("/v1/completions", json.dumps({"prompt": "hi", "seed": 2**70, "temperature": 0.7}), 400, "seed"),
        ("/v1/completions", json.dumps({"prompt": "hi", "seed": 2**64}), 400, "seed"),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}], "seed": 1.5}), 400,
         "seed"),
        ("/v1/completions", json.dumps({"prompt": "hi", "seed": True}), 400, "seed"),
        # a token id outside the vocabulary: refused by the request layer, naming the field
        ("/v1/completions", json.dumps({"prompt": "hi", "logit_bias": {"100000": 1}}), 400, "logit_bias"),
        ("/v1/completions", json.dumps({"prompt": "hi", "priority": 2}), 400, "priority"),  # fcfs reads none
        ("/v1/completions", json.dumps({"prompt": ["hi", "there"]}), 400, "prompt"),
        ("/v1/completions", json.dumps({"prompt": "hi", "echo": True}), 400, "echo"),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}], "logprobs": 3}), 400,
         "logprobs"),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}], "tools": "x"}), 400,
         "tools"),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                             "role_mapping": {"user": 1}}), 400, "role_mapping"),
        ("/v1/completions", json.dumps({"prompt": ""}), 400, "prompt"),
        ("/v1/completions", json.dumps({"prompt": "hi", "model": "gpt-9"}), 404, "model"),
        ("/v1/chat/completions", json.dumps({"messages": "hello"}), 400, "messages"),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": 3}]}), 400, "messages"),
        ("/v1/nothing", b"{}", 404, None),
    ]
    before = read_metrics(capped)
    for path, body, status, param in cases:
        r = post(path, body)
        assert r.status_code == status, (body, r.text)
        error = r.json()["error"]
        assert error["message"] and error["type"] and error["param"] == param, (body, error)
    # /metrics counts every refusal by status (issue 35: 400s and 404s stayed uncounted).
    after = read_metrics(capped)
    for status in (400, 404):
        key = f'kvmetal_http_rejected{{status="{status}"}}'
        assert after.get(key, 0) - before.get(key, 0) == sum(c[2] == status for c in cases), (status, after)
    # The model by its name (what /v1/models lists) or its path.
    r = post("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 1, "model": model_dir.name}))
    assert r.status_code == 200, r.text
    r = post("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}], "n": 3}))
    assert "one choice per request" in r.json()["error"]["message"]
    # A logit bias on a token the model does not have: one line naming the field, not the engine.
    r = post("/v1/completions", json.dumps({"prompt": "hi", "logit_bias": {"100000": 1}}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
    assert "[Engine" not in r.json()["error"]["message"] and "vocabulary size" in r.json()["error"]["message"]
    r = post("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 1, "seed": 2**64 - 1, "temperature": 1}))
    assert r.status_code == 200, r.text  # the largest seed MLX takes
    # Fields mlx_lm.server ignores are ignored here too.
    r = post("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2, "num_draft_tokens": 3, "whatever": 1}))
    assert r.status_code == 200, r.text
    # A prompt that can never fit under the cap: 400 with the numbers.
    too_long = "The paged cache keeps keys and values in fixed blocks. " * 40
    usable = blocks_under_cap(lambda n: model_pool_bytes(kv_layout_model(), n, block_size=16),
                              CAP_BLOCKS * BLOCK_BYTES, block_size=16)
    with pytest.raises(openai.BadRequestError, match=r"the prompt has \d+ tokens; the KV cache cap holds at most "
                                                     rf"{usable * 16} tokens"):
        client(capped).completions.create(model=str(model_dir), prompt=too_long, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match=r"this request needs \d+ tokens \(\d+ in the prompt, 500 to "
                                                     r"generate\)"):
        client(capped).completions.create(model=str(model_dir), prompt="hello", max_tokens=500)
    # still serving, and nothing leaked
    assert chat(capped, QUESTIONS[2], max_tokens=4).choices[0].finish_reason in ("length", "stop")
    wait_idle(capped)


def test_stop_strings_cut_the_text(capped, model_dir):
    full = chat(capped, QUESTIONS[3], max_tokens=20).choices[0].message.content
    assert len(full) > 4
    stop = full[2:4]
    before = wait_idle(capped)
    cut = chat(capped, QUESTIONS[3], max_tokens=20, stop=[stop])
    assert cut.choices[0].message.content == full[:full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    chunks = list(chat(capped, QUESTIONS[3], max_tokens=20, stop=[stop], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full[:full.index(stop)]  # never streamed past
    assert chunks[-1].choices[0].finish_reason == "stop"
    after = wait_idle(capped)  # the stop string aborted the request: its blocks come back
    abort = 'kvmetal_requests_finished{reason="abort"}'
    assert after[abort] == before[abort]  # a stop string is no client abort (see the in-process test below)


def test_a_stop_string_finish_is_counted_as_stop_and_saves_its_prefix(tmp_path):
    # regression: the stop-string abort was counted as reason="abort" and skipped the prefix store.
    # In-process and stepped by hand: over HTTP the tiny model often ends before the abort lands.
    from kvmetal.engine.engine import Engine
    from kvmetal.serve.prefix_store import PrefixStore
    from kvmetal.serve.worker import EngineWorker

    worker = EngineWorker(lambda: Engine(kv_layout_model(), block_size=16, keep_finished=False),
                          prefix_store_factory=lambda e: PrefixStore(tmp_path, {"model": "tiny"}, e.cache))
    worker.setup()
    got = []
    worker.submit("r", list(range(1, 41)), max_tokens=30, sampling=None, stop_token_ids=(), sink=got.append)
    for command in worker._collect(wait=False):
        worker._apply(command)
    for _ in range(4):
        worker._step()
    assert got and all(d.error is None and not d.event.finished for d in got)
    worker.abort("r", reason="stop")
    for command in worker._collect(wait=False):
        worker._apply(command)
    assert worker.finished["stop"] == 1 and worker.finished["abort"] == 0
    worker.store.flush()  # the loop flushes after every step; stepped by hand here
    assert worker.store.saved_blocks >= 2 and worker.engine.cache.used_bytes == 0
    worker.stop()
    worker.serve_forever()
    assert worker.snapshot()["requests_finished"]["stop"] == 1


def test_client_disconnect_mid_stream_frees_its_blocks(capped, model_dir):
    before = wait_idle(capped)
    body = {"model": str(model_dir), "prompt": SYSTEM, "max_tokens": 100, "stream": True}
    with httpx.stream("POST", capped.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
    deadline = time.monotonic() + 20
    while True:
        m = read_metrics(capped)
        if m['kvmetal_requests_finished{reason="abort"}'] > before['kvmetal_requests_finished{reason="abort"}']:
            break
        assert time.monotonic() < deadline, "the disconnected request was never aborted"
        time.sleep(0.02)
    assert m["kvmetal_requests_running"] == 0 and m["kvmetal_kv_used_bytes"] == 0
    assert m["kvmetal_generated_tokens"] - before["kvmetal_generated_tokens"] < 100


def test_restart_with_prompt_cache_dir_gives_prefix_hits(model_dir, tmp_path):
    store = tmp_path / "prefixes"
    question = QUESTIONS[4]
    first = serve(model_dir, "--prompt-cache-dir", store)
    try:
        cold = chat(first, question)
        assert cold.usage.prompt_tokens_details.cached_tokens == 0
    finally:
        stop(first)
    [sub] = [p for p in store.iterdir() if p.is_dir()]
    assert (sub / "index.json").is_file() and list(sub.glob("seg-*.safetensors"))
    # the index stays small: the chain's tokens live in the segment files
    entries = json.loads((sub / "index.json").read_text())["entries"]
    assert entries and all(set(e) == {"start", "end", "parent", "bytes", "used", "uses", "sum"} for e in entries.values())
    second = serve(model_dir, "--prompt-cache-dir", store)
    try:
        warm = chat(second, question)
        m = wait_idle(second)
    finally:
        stop(second)
    assert m["kvmetal_prompt_cache_loaded_blocks"] >= 2 and m["kvmetal_prompt_cache_warnings"] == 0
    hit = warm.usage.prompt_tokens_details.cached_tokens
    assert hit >= 16 * ((cold.usage.prompt_tokens - 1) // 16) and hit > 0
    assert m["kvmetal_prompt_tokens_cached"] == hit
    assert warm.choices[0].message.content == cold.choices[0].message.content


def test_corrupt_or_mismatched_prompt_cache_files_are_ignored(model_dir, tmp_path):
    store = tmp_path / "prefixes"
    first = serve(model_dir, "--prompt-cache-dir", store)
    try:
        cold = chat(first, QUESTIONS[5])
        chat(first, QUESTIONS[6])
    finally:
        stop(first)
    [sub] = [p for p in store.iterdir() if p.is_dir()]
    segments = sorted(sub.glob("seg-*.safetensors"))
    index = json.loads((sub / "index.json").read_text())
    assert len(index["entries"]) >= 2
    # Damage: one file truncated, another segment's tokens changed.
    segments[0].write_bytes(segments[0].read_bytes()[:100])
    key = next(k for k in index["entries"] if f"seg-{k}.safetensors" != segments[0].name)
    import mlx.core as mx

    arrays = dict(mx.load(str(sub / f"seg-{key}.safetensors")))
    arrays["tokens"] = arrays["tokens"] + (mx.arange(arrays["tokens"].size) == 0).astype(mx.int32)
    mx.save_safetensors(str(sub / f"seg-{key}.safetensors"), arrays)
    second = serve(model_dir, "--prompt-cache-dir", store, "--log-level", "INFO")
    try:
        assert read_metrics(second)["kvmetal_prompt_cache_warnings"] >= 2
        assert chat(second, QUESTIONS[5]).choices[0].message.content == cold.choices[0].message.content
    finally:
        stop(second)
    assert "skipped" in second.output
    # An index written for another cache format is not loaded at all.
    index = json.loads((sub / "index.json").read_text())
    index["fingerprint"]["cache"]["block_size"] = 32
    (sub / "index.json").write_text(json.dumps(index))
    third = serve(model_dir, "--prompt-cache-dir", store, "--log-level", "INFO")
    try:
        m = read_metrics(third)
        assert m["kvmetal_prompt_cache_loaded_blocks"] == 0 and m["kvmetal_prompt_cache_warnings"] == 1
        assert chat(third, QUESTIONS[5]).choices[0].message.content == cold.choices[0].message.content
    finally:
        stop(third)
    assert "another model or cache format" in third.output


def test_a_prompt_cache_of_an_older_store_format_is_ignored_with_a_warning(tmp_path, caplog):
    from kvmetal.engine.engine import Engine
    from kvmetal.serve import prefix_store
    from kvmetal.serve.prefix_store import PrefixStore

    engine = Engine(kv_layout_model(), block_size=16, keep_finished=False)
    store = PrefixStore(tmp_path, {"model": "tiny"}, engine.cache)
    old = tmp_path / "0123456789abcdef"
    old.mkdir()
    fingerprint = dict(store.fingerprint, store_format=prefix_store.STORE_FORMAT - 1)
    (old / "index.json").write_text(json.dumps({"fingerprint": fingerprint, "entries": {
        "ab" * 16: {"tokens": list(range(16)), "start": 0, "end": 1}}}))
    with caplog.at_level("WARNING", logger="kvmetal.serve"):
        assert store.load() == 0
    assert "store format" in caplog.text and store.entries == {} and store.warnings == 0
    engine.close()


def test_the_adaptive_policy_takes_priorities_and_preempts_without_changing_answers(model_dir):
    # vLLM's request field: lower is served first; under the cap requests wait and are preempted.
    cap = CAP_BLOCKS * BLOCK_BYTES
    server = serve(model_dir, "--kv-memory", f"{cap}B", "--scheduling-policy", "adaptive",
                   "--long-prefill-tokens", "32")
    try:
        run = lambda i: chat(server, QUESTIONS[i], max_tokens=16 + 4 * (i % 4),  # noqa
                             extra_body={"priority": i % 3 - 1}).choices[0].message.content
        alone = [run(i) for i in range(len(QUESTIONS))]
        with ThreadPoolExecutor(len(QUESTIONS)) as pool:
            together = list(pool.map(run, range(len(QUESTIONS))))
        m = wait_idle(server)
    finally:
        stop(server)
    assert together == alone
    assert m["kvmetal_preemptions"] > 0, "the cap was meant to force preemption"


def test_kv_bits_flags_quantize_the_pool_under_the_same_cap(model_dir):
    # mlx-lm's --kv-bits sets both; kvmetal's --v-bits overrides V: K8/V4 blocks fit ~4x more tokens.
    cap = CAP_BLOCKS * BLOCK_BYTES
    server = serve(model_dir, "--kv-bits", "8", "--v-bits", "4", "--kv-memory", f"{cap}B")
    try:
        long_prompt = "The paged cache keeps keys and values in fixed blocks. " * 20
        r = client(server).completions.create(model=server.model, prompt=long_prompt, max_tokens=8)
        m = read_metrics(server)
    finally:
        stop(server)
    assert r.usage.prompt_tokens > CAP_BLOCKS * 16  # more than a float32 pool under this cap holds
    assert r.usage.completion_tokens > 0
    assert m["kvmetal_kv_pool_bytes"] <= cap and m["kvmetal_kv_peak_used_bytes"] <= cap


def test_cli_rejects_bad_options(model_dir, tmp_path, capsys):
    from kvmetal.serve.cli import main

    assert main(["--model", str(tmp_path)]) == 2
    assert "neither a model directory (no config.json) nor a model name" in capsys.readouterr().err
    from kvmetal.serve.cli import check_args as check, parse_args as parse

    # kvmetal's model names pass the check (serve converts them once, as generate does)
    for name in ("gemma3", "smollm2:float16", "default"):
        assert check(parse(["--model", name])) is None
    assert "smollm2, gemma3" in check(parse(["--model", "gemma"]))
    assert main(["--model", str(model_dir), "--kv-memory", "lots"]) == 2
    assert "kv-memory" in capsys.readouterr().err
    from kvmetal.serve.cli import check_args, parse_args

    assert check_args(parse_args(["--model", str(model_dir), "--kv-group-size", "32"])) is None  # any group size
    server = ServerProcess(model_dir, free_port(), "--kv-memory", "100B")
    with pytest.raises(RuntimeError, match=r"did not start"):
        server.start()
    assert "hold no block" in server.output and server.proc.returncode == 2
    with socket.socket() as taken:  # a port in use: one line, before the model loads
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = ServerProcess(model_dir, port)
        with pytest.raises(RuntimeError, match=r"did not start"):
            server.start(timeout=60)
    assert server.proc.returncode == 2 and f"--port {port}: cannot listen" in server.output
    assert "Traceback" not in server.output


# ---------------------------------------------------------------------------- mlx_lm.server's extra fields


_REFERENCE = {}


def reference(model_dir):
    """mlx-lm's own model and tokenizer for the served directory (loaded once)."""
    if not _REFERENCE:
        from mlx_lm import load

        _REFERENCE["pair"] = load(str(model_dir))
    return _REFERENCE["pair"]


def log_softmax_rows(model_dir, prompt_ids, output_ids):
    """float64 log-softmax of the model's logits at every output position (one full forward
    pass, no cache): row i is the distribution output_ids[i] was picked from."""
    import mlx.core as mx
    import numpy as np

    model, _ = reference(model_dir)
    logits = model(mx.array(prompt_ids + output_ids)[None])[0, len(prompt_ids) - 1:-1]
    logits = np.array(logits.astype(mx.float32), dtype=np.float64)
    return logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)


def test_logprobs_are_the_models_log_softmax_streamed_or_not(capped, model_dir):
    import numpy as np

    c = client(capped)
    _, tokenizer = reference(model_dir)
    messages = [{"role": "user", "content": QUESTIONS[7]}]
    answer = c.chat.completions.create(model=capped.model, messages=messages, max_tokens=8, logprobs=True,
                                       top_logprobs=3)
    content = answer.choices[0].logprobs.content
    ids = [e.model_extra["id"] for e in content]  # mlx_lm.server's token ids ride along
    assert len(ids) == answer.usage.completion_tokens - (answer.choices[0].finish_reason == "stop")
    assert "".join(e.token for e in content) == answer.choices[0].message.content
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    rows = log_softmax_rows(model_dir, prompt, ids)
    for entry, token, row in zip(content, ids, rows):
        assert token == int(row.argmax())  # greedy picked the most likely token
        assert entry.logprob == pytest.approx(row[token], abs=1e-4)
        assert entry.bytes == list(entry.token.encode())
        top = np.argsort(-row)[:3]
        assert [t.model_extra["id"] for t in entry.top_logprobs] == list(top)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(list(row[top]), abs=1e-4)
    chunks = list(c.chat.completions.create(model=capped.model, messages=messages, max_tokens=8, logprobs=True,
                                            top_logprobs=3, stream=True))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    # (the second request finds the prompt in the prefix cache: the same numbers up to rounding)
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)

    # Completions: logprobs is the number of alternatives (OpenAI's legacy shape).
    text = "The paged cache keeps keys and values"
    whole = c.completions.create(model=capped.model, prompt=text, max_tokens=8, temperature=0, logprobs=2)
    lp = whole.choices[0].logprobs
    prompt = tokenizer.encode(text)
    ids = []
    for _ in range(len(lp.tokens)):  # greedy, step by step, from the test's own log-softmax
        ids.append(int(log_softmax_rows(model_dir, prompt, ids + [0])[-1].argmax()))
    rows = log_softmax_rows(model_dir, prompt, ids)
    assert lp.tokens == [tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs == pytest.approx([row[t] for row, t in zip(rows, ids)], abs=1e-4)
    for top, row in zip(lp.top_logprobs, rows):
        best = np.argsort(-row)[:2]
        assert top == pytest.approx({tokenizer.decode([int(t)]): row[t] for t in best}, abs=1e-4)
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(ids))]
    streamed = list(c.completions.create(model=capped.model, prompt=text, max_tokens=8, temperature=0, logprobs=2,
                                         stream=True))
    chunks = [ch.choices[0].logprobs.token_logprobs for ch in streamed if ch.choices[0].logprobs]
    assert [v for chunk in chunks for v in chunk] == pytest.approx(lp.token_logprobs, abs=1e-5)
    plain = c.completions.create(model=capped.model, prompt=text, max_tokens=8, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].text == whole.choices[0].text


def test_penalties_and_logit_bias_match_mlx_lm_processors(capped, model_dir):
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_logits_processors

    model, tokenizer = reference(model_dir)
    c = client(capped)
    text = "The waves come in, the waves go out"
    prompt = tokenizer.encode(text)
    bias_token = tokenizer.encode(" gulls")[0]
    settings = [
        dict(repetition_penalty=1.5, repetition_context_size=8),
        dict(presence_penalty=1.0, frequency_penalty=0.5, frequency_context_size=0),
        dict(logit_bias={bias_token: 4.0}, presence_penalty=0.3),
    ]

    def served(extra):
        body = {k: ({str(t): b for t, b in v.items()} if k == "logit_bias" else v) for k, v in extra.items()}
        return c.completions.create(model=capped.model, prompt=text, max_tokens=16, temperature=0,
                                    extra_body=body).choices[0].text

    def expected(extra):
        processors = make_logits_processors(**extra)  # a completion keeps its first token's space
        return tokenizer.decode([r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=16,
                                                                  logits_processors=processors)])

    plain = served({})
    with ThreadPoolExecutor(len(settings)) as pool:  # batched together: each applies its own processors
        together = list(pool.map(served, settings))
    for extra, got in zip(settings, together):
        assert got == expected(extra), extra
        assert got != plain, f"{extra} changed nothing"
    assert tokenizer.decode([bias_token]) in together[2]


def test_seeded_xtc_and_penalties_are_reproducible_whatever_the_batch(capped):
    kw = dict(temperature=1.0, seed=11, max_tokens=20,
              extra_body={"xtc_probability": 0.8, "xtc_threshold": 0.02, "repetition_penalty": 1.2})
    alone = chat(capped, QUESTIONS[8], **kw).choices[0].message.content
    with ThreadPoolExecutor(4) as pool:
        runs = list(pool.map(lambda q: chat(capped, q, **kw).choices[0].message.content,
                             [QUESTIONS[8], QUESTIONS[9], QUESTIONS[8], QUESTIONS[2]]))
    assert runs[0] == runs[2] == alone
    no_xtc = chat(capped, QUESTIONS[8], temperature=1.0, seed=11, max_tokens=20,
                  extra_body={"repetition_penalty": 1.2}).choices[0].message.content
    assert no_xtc != alone  # XTC cut something


def test_tools_and_template_kwargs_reach_the_chat_template(capped, model_dir):
    from kvmetal.serve import protocol
    from kvmetal.serve.app import ServeState, _tokenize

    class Template:
        has_chat_template = True

        def apply_chat_template(self, messages, **kwargs):
            self.seen = (messages, kwargs)
            return [1, 2, 3]

    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "Rain?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                       "function": {"name": "weather",
                                                                                    "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    body = {"messages": [dict(m) for m in messages], "tools": tools,
            "chat_template_kwargs": {"enable_thinking": False}}
    req = protocol.parse(body, chat=True, defaults=protocol.Defaults())
    tokenizer = Template()
    state = ServeState(worker=None, tokenizer=tokenizer, model_id="m", chat_template_kwargs={"enable_thinking": True,
                                                                                              "x": 1})
    assert _tokenize(state, req) == [1, 2, 3]
    seen_messages, kwargs = tokenizer.seen
    assert seen_messages == messages
    assert kwargs["tools"] == tools and kwargs["enable_thinking"] is False and kwargs["x"] == 1

    class NoTemplate:
        has_chat_template = False

        def encode(self, text):
            self.text = text
            return [5]

    mapping = {"user": "U: ", "assistant": "A: ", "stop": "\n"}
    req = protocol.parse({"messages": [{"role": "user", "content": "hi"}], "role_mapping": mapping}, chat=True,
                         defaults=protocol.Defaults())
    plain = NoTemplate()
    assert _tokenize(ServeState(worker=None, tokenizer=plain, model_id="m"), req) == [5]
    assert plain.text == "U: hi\nA:"  # mlx_lm.server's format, trailing space stripped
    req = protocol.parse({"messages": [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "hi"}]}, chat=True, defaults=protocol.Defaults())
    assert _tokenize(ServeState(worker=None, tokenizer=plain, model_id="m"), req) == [5]
    assert plain.text == "system: Be brief.\nuser: hi\nassistant:"  # no trailing space either
    # The real server takes tools (its template ignores them) instead of rejecting the request.
    r = client(capped).chat.completions.create(model=capped.model, messages=messages[:1], tools=tools, max_tokens=3)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_bench_summary_survives_a_run_where_every_request_failed(monkeypatch):
    # regression: 1e3 * percentile(...) crashed on None when no request succeeded
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "serve_load.py"
    spec = importlib.util.spec_from_file_location("serve_load", path)
    serve_load = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve_load)
    monkeypatch.setattr(serve_load, "one_request", lambda url, model, body: {"error": "503 down"})
    summary = serve_load.replay("http://127.0.0.1:9", "m", [{"path": "/completions"}] * 3, 2)
    assert summary["errors"] == 3 and summary["first_error"] == "503 down"
    assert summary["ttft_p50_ms"] is None and summary["ttft_p95_ms"] is None and summary["tpot_p50_ms"] is None


def test_a_chat_without_a_chat_template_stops_at_the_next_user_line():
    """Issue 44: the base Gemma chat ran on into "\\nuser: ..." (its prompt is role-prefixed
    lines); such chats stop where a new turn starts, added to the request's own stop strings."""
    from kvmetal.serve import protocol
    from kvmetal.serve.app import ServeState, TextStream, with_default_stop

    class Plain:
        has_chat_template = False

    class Templated:
        has_chat_template = True

    def parsed(messages=({"role": "user", "content": "hi"},), **extra):
        return protocol.parse({"messages": [dict(m) for m in messages], **extra}, chat=True,
                              defaults=protocol.Defaults())

    plain = ServeState(worker=None, tokenizer=Plain(), model_id="m")
    assert with_default_stop(plain, parsed()).stop == ["\nuser:", "\nassistant:"]
    assert with_default_stop(plain, parsed(stop=["END"])).stop == ["END", "\nuser:", "\nassistant:"]
    assert with_default_stop(plain, parsed(stop="\nuser:")).stop == ["\nuser:", "\nassistant:"]
    system = parsed([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    assert with_default_stop(plain, system).stop == ["\nuser:", "\nassistant:", "\nsystem:"]
    assert with_default_stop(plain, parsed(role_mapping={"user": "U: "})).stop == []  # the caller's format
    assert with_default_stop(ServeState(worker=None, tokenizer=Templated(), model_id="m"), parsed()).stop == []
    completion = protocol.parse({"prompt": "user: hi\nassistant:"}, chat=False, defaults=protocol.Defaults())
    assert with_default_stop(plain, completion).stop == []  # a completion's text is the caller's

    pieces = [" Paris", ".", "\n", "user", ":", " and"]

    class Detok:  # what TextStream reads: the text so far, token by token
        text = ""

        def add_token(self, token):
            self.text += pieces[token]

        def finalize(self):
            pass

    class Tok:
        detokenizer = Detok()

    stream = TextStream(Tok(), with_default_stop(plain, parsed()).stop)
    out = ""
    for token in range(len(pieces)):
        stream.add(token)
        out += stream.take()
    out += stream.take(final=True)
    assert out == " Paris." and stream.stopped
