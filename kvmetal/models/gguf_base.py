"""What every GGUF reader and converter of kvmetal shares: the error, the dtype choices,
metadata scalars, and the header's value-type codes (no converter imports another's module
through ``gguf.py``, which dispatches to them)."""
from __future__ import annotations

DTYPES = ("keep", "float32", "float16", "bfloat16")


class GGUFError(ValueError):
    """A GGUF file this converter cannot turn into an mlx-lm directory (one line)."""


def _scalar(meta: dict, key: str, *, required: bool = True, default=None):
    value = meta.get(key)
    if value is None:
        if required:
            raise GGUFError(f"GGUF metadata has no {key!r}")
        return default
    if hasattr(value, "item"):  # mx.array scalars
        value = value.item() if value.size == 1 else value.tolist()
    return value


def _float32(value) -> float:
    """A GGUF float32 as the shortest decimal that reads back to it (1e-05, not 9.99e-06)."""
    return float(f"{float(value):.7g}")


def module_path(gguf_name: str, *, top_level: dict, per_layer: dict, family: str) -> str:
    """A GGUF tensor name as the mlx-lm module path of ``family``: ``blk.3.<piece>.weight`` ->
    ``model.layers.3.<per_layer[piece]>.weight``, ``<piece>.weight`` -> ``<top_level[piece]>.weight``."""
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in per_layer:
        return f"model.layers.{parts[1]}.{per_layer[parts[2]]}.{suffix}"
    if len(parts) == 1 and parts[0] in top_level:
        return f"{top_level[parts[0]]}.{suffix}"
    raise GGUFError(f"GGUF tensor {gguf_name!r} has no {family} counterpart")


# GGUF metadata value types -> struct format (strings and arrays are read separately)
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def hf_tokenizer_config(meta: dict, tokens: list, *, arch: str, add_bos: bool, add_eos: bool, bos, eos, pad,
                        unk) -> tuple:
    """(tokenizer_config.json, special token ids) of a GGUF vocabulary, for any architecture:
    the special tokens by id, the context length as ``model_max_length``, the chat template."""
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_scalar(meta, f"{arch}.context_length", required=False, default=2048)),
    }
    for label, value in (("bos_token", bos), ("eos_token", eos), ("pad_token", pad), ("unk_token", unk)):
        if value is not None:
            tokenizer_config[label] = tokens[value]
    chat_template = _scalar(meta, "tokenizer.chat_template", required=False)
    if chat_template:
        tokenizer_config["chat_template"] = chat_template
    ids = {k: v for k, v in (("bos_token_id", bos), ("eos_token_id", eos), ("pad_token_id", pad)) if v is not None}
    return tokenizer_config, ids
