"""A SentencePiece-style GGUF vocabulary (``tokenizer.ggml.model == "llama"``) as a
Hugging Face ``tokenizer.json`` that mlx-lm's tokenizer wrapper loads.

The GGUF holds pieces, scores and token types, not merges. llama.cpp tokenizes such a
vocabulary the SentencePiece-BPE way: spaces become ``▁``, the text starts as single
characters, and the adjacent pair whose concatenation is the highest-scoring piece is
merged until none is; characters outside the vocabulary fall back to ``<0xXX>`` byte
pieces. A BPE model whose merges are ranked by the merged piece's score does the same
(Hugging Face's own SentencePiece conversion builds its merges this way), so this
module writes one: every split of every normal piece into two normal pieces is a merge,
ranked by the whole piece's score (ties by the halves' ids). Control pieces (type 3) and
user-defined pieces (type 4: Gemma's runs of newlines, spaces and tabs, HTML tags) are
added tokens matched in the raw text first, as llama.cpp partitions them out first;
control ones are special (skipped when decoding with ``skip_special_tokens``).
"""
from __future__ import annotations

from .gguf_base import GGUFError, _scalar, hf_tokenizer_config

# GGUF token types (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"  # ▁


def spm_merges(tokens: list, scores: list, types: list) -> list:
    """``[[left, right], ...]``: every split of a normal piece into two normal pieces,
    best-scoring merged piece first (ties: the halves' ids)."""
    normal = {t: i for i, t in enumerate(tokens) if int(types[i]) == NORMAL}
    ranked = []
    for piece, i in normal.items():
        splits = []
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                splits.append((normal[left], normal[right], left, right))
        splits.sort()
        ranked.extend((-float(scores[i]), li, ri, left, right) for li, ri, left, right in splits)
    ranked.sort()
    return [[left, right] for *_, left, right in ranked]  # pairs: a piece may hold a plain space


def spm_tokenizer_files(meta: dict) -> tuple[dict, dict, dict]:
    """(tokenizer.json, tokenizer_config.json, config.json token ids) from the GGUF metadata."""
    model = _scalar(meta, "tokenizer.ggml.model")
    if model != "llama":
        raise GGUFError(f"GGUF tokenizer {model!r} is not a SentencePiece ('llama') vocabulary")
    tokens = meta.get("tokenizer.ggml.tokens")
    scores = meta.get("tokenizer.ggml.scores")
    types = meta.get("tokenizer.ggml.token_type")
    for key, value in (("tokens", tokens), ("scores", scores), ("token_type", types)):
        if not value:
            raise GGUFError(f"GGUF metadata has no 'tokenizer.ggml.{key}'")
    if not len(tokens) == len(scores) == len(types):
        raise GGUFError(f"GGUF has {len(tokens)} tokens, {len(scores)} scores and {len(types)} token types")
    bad = sorted({int(t) for t in types} - {NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE})
    if bad:
        raise GGUFError(f"GGUF token type {bad[0]} is not a llama.cpp token type")

    def token_id(key):
        value = _scalar(meta, f"tokenizer.ggml.{key}", required=False)
        if value is not None and not 0 <= int(value) < len(tokens):
            raise GGUFError(f"GGUF {key} {value} is outside the vocabulary of {len(tokens)}")
        return None if value is None else int(value)

    bos, eos, pad, unk = (token_id(k) for k in ("bos_token_id", "eos_token_id", "padding_token_id",
                                                 "unknown_token_id"))
    add_bos = bool(_scalar(meta, "tokenizer.ggml.add_bos_token", required=False, default=True))
    add_eos = bool(_scalar(meta, "tokenizer.ggml.add_eos_token", required=False, default=False))
    prefix_space = bool(_scalar(meta, "tokenizer.ggml.add_space_prefix", required=False, default=True))
    if add_bos and bos is None:
        raise GGUFError("GGUF asks to add a bos token but has no 'tokenizer.ggml.bos_token_id'")
    if add_eos and eos is None:
        raise GGUFError("GGUF asks to add an eos token but has no 'tokenizer.ggml.eos_token_id'")
    if not any(int(t) == BYTE for t in types):
        raise GGUFError("GGUF SentencePiece vocabulary has no <0xXX> byte pieces (byte fallback)")

    ids_of_note = {i for i in (bos, eos, pad, unk) if i is not None}
    added = [{"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": int(types[i]) != USER_DEFINED}
             for i in range(len(tokens)) if int(types[i]) in (CONTROL, USER_DEFINED, UNKNOWN) or i in ids_of_note]

    replace = {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}
    normalizer = {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": SPACE}, replace]} \
        if prefix_space else replace
    decoders = [{"type": "Replace", "pattern": {"String": SPACE}, "content": " "}, {"type": "ByteFallback"},
                {"type": "Fuse"}]
    if prefix_space:  # the prepended ▁ of the first word comes back off
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})

    post = None
    if add_bos or add_eos:
        def template(pair: bool) -> list:
            pieces = [{"Sequence": {"id": "A", "type_id": 0}}]
            if add_bos:
                pieces.insert(0, {"SpecialToken": {"id": tokens[bos], "type_id": 0}})
            if add_eos:
                pieces.append({"SpecialToken": {"id": tokens[eos], "type_id": 0}})
            return pieces + ([{"Sequence": {"id": "B", "type_id": 1}}] if pair else [])

        used = [i for i, flag in ((bos, add_bos), (eos, add_eos)) if flag]
        post = {"type": "TemplateProcessing", "single": template(False), "pair": template(True),
                "special_tokens": {tokens[i]: {"id": tokens[i], "ids": [i], "tokens": [tokens[i]]} for i in used}}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": None,
        "post_processor": post,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {"type": "BPE", "dropout": None, "unk_token": None if unk is None else tokens[unk],
                  "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True,
                  "byte_fallback": True, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)},
                  "merges": spm_merges(tokens, scores, types)},
    }
    arch = _scalar(meta, "general.architecture", required=False, default="llama")
    tokenizer_config, ids = hf_tokenizer_config(meta, tokens, arch=arch, add_bos=add_bos, add_eos=add_eos,
                                                bos=bos, eos=eos, pad=pad, unk=unk)
    return tokenizer, tokenizer_config, ids
