"""``kvmetal serve`` sampling against mlx-lm's rule, statistically: the first tokens of many
seeded /v1/completions requests vs the exact distribution computed here from the served
model's own logits (tests/sampling_oracle.py). The model directory is the tiny llama with
a peaked ``lm_head``."""
from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from kvmetal.serve.server import ServerProcess  # noqa: E402
from kvmetal.serve.tiny import build_model_dir  # noqa: E402
from sampling_oracle import (ARGMAX_CONFIGS, CONFIGS, assert_matches_distribution,  # noqa: E402
                             check_mlx_lm_filters_agree, first_token_logits, mlx_lm_distribution,
                             peak_lm_head, target_logits)

PROMPT = [40, 51, 62, 73, 84, 95]  # token ids: the served prompt is exactly these
# A served request costs far more than an Engine one: the server runs the configurations
# that exercise each protocol field (temperature, top_p, top_k, min_p) with fewer draws;
# tests/test_engine_sampling.py runs them all.
SERVED = ["t0.5", "t0.7+top_p+min_p", "t2+min_p+top_k", "t1.5+top_p+top_k"]
SERVED_DRAWS = 200


def _candidates(tokenizer, count: int) -> list:
    """Token ids whose text is an ASCII word no other token decodes to (the reply's text
    then names the token)."""
    texts = {}
    for i in range(tokenizer.vocab_size):
        texts.setdefault(tokenizer.decode([i]), []).append(i)
    ids = [ids[0] for text, ids in texts.items() if len(ids) == 1 and text.isascii() and text.isalpha()
           and len(text) >= 3]
    return ids[5:5 + count]


@pytest.fixture(scope="module")
def peaked_server(tmp_path_factory):
    from mlx_lm import load
    from mlx_lm.utils import save_model

    path = build_model_dir(tmp_path_factory.mktemp("peaked-llama"))
    model, tokenizer = load(str(path))
    candidates = _candidates(tokenizer, 8)
    assert len(candidates) == 8
    peak_lm_head(model, PROMPT, target_logits(model.args.vocab_size, candidates))
    save_model(path, model)
    model, _ = load(str(path))  # the exact distribution comes from what the server loads
    logits = first_token_logits(model, PROMPT)
    assert sorted(np.argsort(-logits)[:8].tolist()) == sorted(candidates)
    text_to_id = {tokenizer.decode([i]): i for i in candidates}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ServerProcess(path, port, "--log-level", "WARNING").start()
    server.model = str(path)
    yield server, logits, text_to_id
    assert server.stop() == 0, server.output


def first_tokens(server, text_to_id, params: dict, draws: int = SERVED_DRAWS) -> list:
    """The first token of ``draws`` requests (seeds 0..draws-1), sent 16 at a time; a reply
    whose text is no candidate's counts as token -1 (a token outside the candidates)."""
    def one(seed):
        body = dict(model=server.model, prompt=PROMPT, max_tokens=1, seed=seed, **params)
        reply = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        return text_to_id.get(reply.json()["choices"][0]["text"], -1)

    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(one, range(draws)))


@pytest.mark.parametrize("name", SERVED)
def test_served_first_token_follows_mlx_lm_sampling(peaked_server, name):
    server, logits, text_to_id = peaked_server
    params = dict(CONFIGS)[name]
    check_mlx_lm_filters_agree(logits, **{k: v for k, v in params.items() if k != "temperature"})
    tokens = first_tokens(server, text_to_id, params)
    assert -1 not in tokens, "the server drew a token outside the eight candidates (mass < 1e-15)"
    assert_matches_distribution(tokens, mlx_lm_distribution(logits, **params))


def test_served_argmax_limits(peaked_server):
    server, logits, text_to_id = peaked_server
    for name, params in ARGMAX_CONFIGS:
        assert set(first_tokens(server, text_to_id, params, draws=32)) == {int(np.argmax(logits))}, name
