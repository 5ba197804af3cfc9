"""The decode step's use of the cascade op: the grouping rule
(kvmetal/integrations/cascade_plan.py) and the model cache's one-token passes, which
must give the same greedy tokens as the plain op and count their cascade passes."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_lm")

from kvmetal.integrations import cascade_plan, tiny_models  # noqa: E402
from kvmetal.integrations.mlx_lm import use_paged_cache  # noqa: E402
from kvmetal.integrations.model_cache import PagedModelCache  # noqa: E402


# ----------------------------------------------------------------------------- the rule

def test_groups_need_enough_members_and_shared_blocks():
    bs = 16
    shared = [7, 3, 9, 4]
    tables = np.array([shared + [20 + s, 30 + s] for s in range(5)] + [[1, 2, 5, 6, 8, 0]], np.int32)
    lens = np.array([4 * bs + 5, 4 * bs + 20, 4 * bs, 5 * bs + 1, 4 * bs + 1, 6 * bs], np.int32)
    groups = cascade_plan.group_shared_prefixes(tables, lens, block_size=bs, min_members=5, min_blocks=4)
    assert groups is not None
    assert groups.prefix_block_tables.tolist() == [shared] and groups.prefix_lens.tolist() == [4 * bs]
    assert groups.prefix_of.tolist() == [0, 0, 0, 0, 0, -1]
    assert groups.seq_lens.tolist() == [5, 20, 0, bs + 1, 1, 6 * bs]   # sequence 2 is all prefix
    assert groups.block_tables[0, :2].tolist() == [20, 30] and groups.block_tables[5].tolist() == tables[5].tolist()
    assert groups.shared_tokens == 4 * 4 * bs
    # Too few members, or too short a shared run: no cascade.
    assert cascade_plan.group_shared_prefixes(tables, lens, block_size=bs, min_members=6, min_blocks=4) is None
    assert cascade_plan.group_shared_prefixes(tables, lens, block_size=bs, min_members=5, min_blocks=5) is None


def test_a_shared_run_ends_where_members_diverge_and_inside_every_member():
    bs = 8
    tables = np.array([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6, 7]], np.int32)
    lens = np.array([32, 32, 20], np.int32)  # the third holds 2 whole blocks
    groups = cascade_plan.group_shared_prefixes(tables, lens, block_size=bs, min_members=3, min_blocks=2)
    assert groups.prefix_block_tables.tolist() == [[1, 2]] and groups.prefix_lens.tolist() == [16]
    # A sequence whose last (partial) block is shared never puts it in the prefix.
    tables = np.array([[1, 2], [1, 2], [1, 2]], np.int32)
    groups = cascade_plan.group_shared_prefixes(tables, np.array([12, 12, 12]), block_size=bs, min_members=3,
                                                min_blocks=1)
    assert groups.prefix_lens.tolist() == [8] and groups.seq_lens.tolist() == [4, 4, 4]


def test_default_thresholds():
    bs = 16
    blocks = cascade_plan.MIN_PREFIX_TOKENS // bs
    n = cascade_plan.MIN_MEMBERS
    tables = np.array([list(range(blocks)) + [100 + s] for s in range(n)], np.int32)
    lens = np.full(n, blocks * bs + 3, np.int32)
    assert cascade_plan.group_shared_prefixes(tables, lens, block_size=bs) is not None
    assert cascade_plan.group_shared_prefixes(tables[:-1], lens[:-1], block_size=bs) is None
    assert cascade_plan.group_shared_prefixes(tables, lens - 4 * bs, block_size=bs) is None


# ----------------------------------------------------------------------------- the model cache

def greedy(model, cache, prompts, steps):
    """Prefill each prompt alone (later ones find the shared prefix blocks cached), then
    ``steps`` batched greedy decode steps; the tokens of each sequence."""
    ids, outs = [], []
    for i, prompt in enumerate(prompts):
        start = cache.add_sequence(i, prompt)
        logits = model(mx.array(prompt[start:])[None], cache=cache.layer_caches([i], [start]))
        ids.append(i)
        outs.append([int(mx.argmax(logits[0, -1]))])
    for _ in range(steps):
        for i in ids:
            cache.append(i, [outs[i][-1]])
        offsets = [cache.num_tokens(i) - 1 for i in ids]
        logits = model(mx.array([[o[-1]] for o in outs]), cache=cache.layer_caches(ids, offsets))
        for i, t in enumerate(mx.argmax(logits[:, -1, :], axis=-1).tolist()):
            outs[i].append(int(t))
    return outs


@pytest.mark.parametrize("family,k_bits,v_bits", [("llama", None, None), ("gpt_oss", None, None),
                                                  ("llama", 8, 4)])
def test_greedy_tokens_match_the_plain_op(monkeypatch, family, k_bits, v_bits):
    """5 sequences over a shared 64-token prompt (thresholds lowered to fit a quick test):
    the cascade passes run, and every sequence's greedy tokens are the plain op's."""
    monkeypatch.setattr(cascade_plan, "MIN_MEMBERS", 4)
    monkeypatch.setattr(cascade_plan, "MIN_PREFIX_TOKENS", 48)
    model = tiny_models.build(family)
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 512, size=64).tolist()
    prompts = [shared + rng.integers(0, 512, size=n).tolist() for n in (3, 7, 1, 12, 5)]
    steps = 12
    runs = {}
    with use_paged_cache(model) as handle:   # routes the model's attention to the paged caches
        for on in (False, True):
            cache = PagedModelCache(handle.specs, block_size=16, k_bits=k_bits, v_bits=v_bits, cascade=on)
            runs[on] = (greedy(model, cache, prompts, steps), cache.cascade_steps)
    assert runs[True][0] == runs[False][0]
    assert runs[False][1] == 0
    full_groups = 1  # llama: one full-attention group; gpt_oss: a window group (plain op) and a full one
    assert runs[True][1] == steps * full_groups


def test_a_sparse_v_cache_passes_its_tau_to_the_cascade(monkeypatch):
    from kvmetal import ops

    monkeypatch.setattr(cascade_plan, "MIN_MEMBERS", 4)
    monkeypatch.setattr(cascade_plan, "MIN_PREFIX_TOKENS", 48)
    seen = []
    original = ops.paged_attention_cascade
    monkeypatch.setattr(ops, "paged_attention_cascade",
                        lambda *a, **kw: seen.append(kw.get("sparse_v")) or original(*a, **kw))
    model = tiny_models.build("llama")
    rng = np.random.default_rng(1)
    shared = rng.integers(0, 512, size=64).tolist()
    prompts = [shared + rng.integers(0, 512, size=n).tolist() for n in (3, 7, 1, 12)]
    with use_paged_cache(model) as handle:
        cache = PagedModelCache(handle.specs, block_size=16, cascade=True, sparse_v=1e-6)
        greedy(model, cache, prompts, 2)
    assert cache.cascade_steps == 2 and seen and all(t == 1e-6 for t in seen)


def test_below_the_thresholds_nothing_changes():
    model = tiny_models.build("llama")
    prompts = [[1, 2, 3, 4] * 8 + [s] for s in range(3)]   # 3 sequences, 2 shared blocks: under the defaults
    with use_paged_cache(model) as handle:
        cache = PagedModelCache(handle.specs, block_size=16)
        greedy(model, cache, prompts, 3)
    assert cache.options["cascade"] and cache.cascade_steps == 0


# ----------------------------------------------------------------------------- a serve run

def test_serve_counts_cascade_steps_and_keeps_the_tokens(tmp_path):
    """``--cascade``, 10 concurrent greedy completions over an 800-token shared system prompt: decode
    steps with >= 8 running requests read the prefix once (kvmetal_cascade_steps > 0), and
    each text is what that request gets alone (batch 1: the plain op)."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    httpx = pytest.importorskip("httpx")
    import socket
    from concurrent.futures import ThreadPoolExecutor

    from kvmetal.serve import metrics
    from kvmetal.serve.server import ServerProcess
    from kvmetal.serve.tiny import build_model_dir

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    model_dir = build_model_dir(tmp_path / "model")
    system = ("You are a helpful assistant. Answer the question briefly and say when you do not know. "
              "The paged cache keeps keys and values in fixed blocks. ") * 12
    server = ServerProcess(model_dir, port, "--cascade", "--log-level", "WARNING").start()
    try:
        def complete(i):
            r = httpx.post(server.url + "/v1/completions", timeout=300,
                           json={"model": str(model_dir), "prompt": system + f" Question {i}: why?", "max_tokens": 64,
                                 "temperature": 0})
            return r.json()["choices"][0]["text"]

        complete(0)  # the shared prompt's blocks are cached: the 10 below join within a step or two
        # (64 tokens each: on a loaded host their arrivals spread, and >= 8 must decode at once)
        with ThreadPoolExecutor(10) as pool:
            together = list(pool.map(complete, range(10)))
        m = metrics.parse(httpx.get(server.url + "/metrics").text)
        assert m["kvmetal_cascade_steps"] > 0 and m["kvmetal_prompt_tokens_cached"] > 0
        alone = [complete(i) for i in (0, 7)]
        assert alone == [together[0], together[7]]
    finally:
        assert server.stop() == 0, server.output
