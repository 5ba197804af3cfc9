"""Every architecture of the installed mlx-lm, built tiny and random, under ``use_paged_cache``.

``architectures()`` walks ``mlx_lm.models`` (pkgutil) for modules with a ``ModelArgs`` and a
``Model``; ``tiny_args(name)`` derives a small config from the module's ``ModelArgs`` fields
(``derive``: ``SIZES`` by field name; nested configs the same way: a wrapper's ``text_config``
from the class its code reads it into, a required field annotated with a config dataclass,
``block_configs`` one per layer; then any other required field by name and annotated type,
``_required_value``), with a few per-architecture ``OVERRIDES`` where a family's code demands
a structure no rule derives (a layer pattern that must contain an attention layer, a module
manifest). A family mlx-lm adds is picked up without editing anything here.

``check(name)`` compares, on the cpu backend in float32, the logits of a prefill and
``DECODE_STEPS`` greedy decode steps with mlx-lm's own cache against kvmetal's paged cache
(max relative difference, greedy tokens identical), runs the same path teacher-forced
with a K8/V4 cache (finite, top-1 agreement with float), and checks ``generate_step``'s
tokens are unchanged. ``tools/model_coverage.py`` writes the table; the test is
tests/test_mlx_lm_all_models.py.
"""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import time
import types
import typing

import mlx.core as mx
import numpy as np

PROMPT_TOKENS = 20  # crosses a 16-token block
DECODE_STEPS = 16
WINDOW = 24  # sliding windows, so that prompt + decode (36 tokens) runs past them
VOCAB = 256
LAYERS = 2  # every per-layer list is this long (SIZES' layer counts)
TOLERANCE = 1e-4  # max |paged - mlx-lm| / max |mlx-lm| over every logit, float32

# Values for fields by name, used whether or not the field has a default (a default is
# usually a full-size model's). head_dim 64: hidden 256 over 4 heads, or set directly.
SIZES = dict(
    hidden_size=256, d_model=256, n_embd=256, dim=256, model_dim=256, embedding_size=256,
    num_hidden_layers=2, num_layers=2, n_layer=2, n_layers=2, num_transformer_layers=2,
    intermediate_size=256, n_inner=256, ffn_hidden_size=256, ff_intermediate_size=256, hidden_dim=256,
    intermediate_size_mlp=256, mlp_hidden_size=256, shared_intermediate_size=128, block_dim=256,
    num_attention_heads=4, n_head=4, n_heads=4, num_heads=4, num_query_heads=4,
    num_key_value_heads=2, num_kv_heads=2, n_kv_heads=2, multi_query_group_num=2,
    head_dim=64, v_head_dim=64, kv_channels=64, vocab_size=VOCAB,
    moe_intermediate_size=64, expert_ffn_hidden_size=64, shared_expert_intermediate_size=64,
    num_experts=4, n_routed_experts=4, num_local_experts=4, moe_num_experts=4,
    num_experts_per_tok=2, num_experts_per_token=2, moe_topk=2,
    n_shared_experts=1, num_shared_experts=1, num_shared_expert=1,
    n_group=1, topk_group=1, first_k_dense_replace=1, num_dense_layers=1,
    kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=48,
    sliding_window=WINDOW, sliding_window_size=WINDOW, attention_window_size=WINDOW, loop_window_size=WINDOW,
    max_position_embeddings=4096, n_positions=4096, n_ctx=4096, model_max_length=4096,
    tie_word_embeddings=False,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
    linear_conv_kernel_dim=4, conv_kernel=4, conv_L_cache=3, conv1d_width=4,
    state_size=16, ssm_state_size=16, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
    mamba_num_heads=8, mamba_head_dim=32, n_groups=1, time_step_rank=16,
    index_head_dim=32, index_n_heads=2, index_topk=8,
    rope_theta=10000.0, sliding_window_pattern=2, full_attention_interval=2,
    rms_norm_eps=1e-5, norm_eps=1e-5, layer_norm_eps=1e-5, layer_norm_epsilon=1e-5, layernorm_epsilon=1e-5,
    decoder_sparse_step=1, norm_topk_prob=True,
    # per-layer patterns of a 2-layer model: one window (or recurrent) layer, one full
    layer_types=["sliding_attention", "full_attention"], is_moe_layer=[False, True],
    mlp_only_layers=[], sliding_window_layers=[0], moe_layer_freq=[0, 1], hybrid_layer_pattern=[1, 0],
    no_rope_layers=[1, 1], cla_share_factor=2, time_step_limit=(0.0, float("inf")),
    # 2 layers cannot share K/V: a sharing layer reads an earlier layer of its own type
    num_kv_shared_layers=0,
    # per-layer block configs (nemotron-nas): query heads per kv head, FFN width over hidden
    n_heads_in_group=2, ffn_mult=1.0,
)
# Required fields of other names, by annotated type.
BY_TYPE = {int: 2, float: 1.0, bool: False, str: ""}

# Per architecture, only where its code demands a structure no rule derives. A dict given
# for text_config refines the derived one (_refine), anything else replaces the field.
_ROPE4 = {"llama_4_scaling_beta": 0.0, "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
          "rope_type": "default"}
_KDA = {"kda_layers": [1], "full_attn_layers": [2], "num_heads": 4, "head_dim": 32,
        "short_conv_kernel_size": 4}  # kimi delta attention: layer 1 linear, layer 2 full
OVERRIDES: dict = {
    "gemma2": dict(attn_logit_softcapping=0.5),  # scores of a tiny model are small: make the cap bite
    "dbrx": dict(ffn_config={"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2},
                 attn_config={"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0}),
    "deepseek_v2": dict(rope_scaling={"factor": 1.0, "mscale_all_dim": 0, "mscale": 1.0, "beta_fast": 32,
                                      "beta_slow": 1, "original_max_position_embeddings": 4096}),
    "minicpm3": dict(rope_scaling={"original_max_position_embeddings": 4096, "short_factor": 1.0,
                                   "long_factor": 1.0}),
    "jamba": dict(attn_layer_offset=1, attn_layer_period=2, expert_layer_offset=1, expert_layer_period=2),
    "nemotron_h": dict(layer_types=None, hybrid_override_pattern=["M", "*"]),
    "mellum": dict(rope_parameters={t: {"rope_theta": 10000.0, "rope_type": "default"}
                                    for t in ("full_attention", "sliding_attention")}),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"], mamba_n_heads=8, mamba_d_head=32,
                             mamba_d_state=16, mamba_d_conv=4, mamba_n_groups=1, mamba_proj_bias=False,
                             mamba_conv_bias=True),
    "gemma4": dict(text_config=dict(model_type="gemma4_text")),  # overrides merge into derived text configs
    # llama4: no MLA fields in its text_config (the model ignores them; a saved config with
    # kv_lora_rank reads as MLA to kvmetal.budget, which `kvmetal generate -m DIR` consults)
    "llama4": dict(text_config=dict({k: v for k, v in SIZES.items() if not isinstance(v, list) and "lora" not in k},
                                    attention_bias=False, attention_chunk_size=16, interleave_moe_layer_step=1,
                                    rope_scaling=None, use_qk_norm=True, model_type="llama4_text",
                                    num_experts_per_tok=1, num_hidden_layers=4)),
    "plamo": dict(n_shared_head=2),
    "glm_moe_dsa": dict(rope_parameters={"rope_theta": 10000.0, "type": "default", "factor": 1.0}),
    "kimi_linear": dict(linear_attn_config=_KDA),
    "kimi_k3": dict(text_config=dict(linear_attn_config=_KDA)),
    # mlx-lm sets LongcatFlashMLA.mla_scale_*_lora only when the flag is on (off, the attribute
    # is missing and __call__ fails); its MoE asserts identity zero experts
    "longcat_flash": dict(mla_scale_q_lora=True, mla_scale_kv_lora=True, zero_expert_type="identity"),
    "longcat_flash_ngram": dict(mla_scale_q_lora=True, mla_scale_kv_lora=True),
    # Model.__call__ writes -inf at fixed token ids 100256..100351: a smaller vocabulary makes
    # that scatter write out of bounds (MLX's cpu backend then corrupts memory and aborts)
    "phi3small": dict(vocab_size=100352),
    # a Hadamard pack: schema/namespace/quantization are checked constants, and its module
    # manifest names the linears it replaces (here the attention layer's k and v projections,
    # 2-bit; block 0: no rotation, the smallest block, 512, exceeds this model's width)
    "prism_hadamard_qwen35": dict(
        schema_version=1, tensor_namespace="mlx-lm-text",
        quantization={"bits": 2, "group_size": 128, "mode": "affine"},
        modules=[{"path": f"model.layers.1.self_attn.{p}_proj", "embedding": False, "dtype": "float16",
                  "block": 0} for p in "kv"]),
    "muse_spark": dict(text_config=dict(num_shared_experts=0)),  # it raises on shared experts
    # gemma3n's checkpoints share K/V: their last layers attend over an earlier layer's rows
    # (keys_and_values()). 2 layers cannot share (a sharing layer needs an earlier one of its
    # own type), so 4, the last 2 sharing, as shipped
    "gemma3n": dict(text_config=dict(num_hidden_layers=4, num_kv_shared_layers=2,
                                     layer_types=["sliding_attention", "full_attention"] * 2,
                                     activation_sparsity_pattern=[0.0] * 4)),
    "hunyuan": dict(rope_scaling={"alpha": 1.0, "factor": 1.0, "type": "dynamic"}),
    "phi": dict(partial_rotary_factor=0.5),
    "recurrent_gemma": dict(block_types=["recurrent", "attention"]),
    "step3p5": dict(moe_top_k=2),
    "spark2_5": dict(rope_parameters={t: {"rope_theta": 10000.0, "rope_type": "default"}
                                      for t in ("full_attention", "sliding_attention")}),
    "mimo_v2_flash": dict(topk_method="noaux_tc"),
    "openelm": dict(num_query_heads=[4, 4], num_kv_heads=[2, 2], ffn_multipliers=[1.0, 1.0], ffn_dim_divisor=8),
    "ministral3": dict(rope_parameters=_ROPE4),
    "mistral4": dict(rope_parameters=_ROPE4),
    "mistral3": dict(text_config=dict(model_type="ministral3")),  # + ministral3's own override
}


@dataclasses.dataclass
class Row:
    """One architecture's result (``status``: exact, refused, broken or unbuilt)."""

    name: str
    status: str
    reason: str = ""
    max_rel_diff: float | None = None
    greedy_identical: bool | None = None
    generate_step_identical: bool | None = None
    k8v4_finite: bool | None = None
    k8v4_top1: float | None = None
    paged_layers: int | None = None
    native_layers: int | None = None
    gathered_calls: int | None = None  # attention calls that took the model's own mask array (gather + MLX sdpa)
    seconds: float = 0.0
    head_dims: list | None = None  # the paged layers' head dims, ascending (tests pick models by them)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def architectures() -> list:
    """Names of the mlx_lm.models modules that define ``ModelArgs`` and ``Model``."""
    import mlx_lm.models as pkg

    names = []
    for info in pkgutil.iter_modules(pkg.__path__):
        try:
            module = importlib.import_module(f"mlx_lm.models.{info.name}")
        except (Exception, SystemExit):  # an optional dependency missing (olmo exits): unbuilt
            names.append(info.name)
            continue
        if hasattr(module, "ModelArgs") and hasattr(module, "Model"):
            names.append(info.name)
    return sorted(names)


def _options(kind) -> list:
    """The types a ``Union``/``X | None`` annotation allows (without ``None``), else ``[kind]``."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return [k for k in typing.get_args(kind) if k is not type(None)]
    return [kind]


def _fits(value, kind) -> bool:
    """Whether a SIZES value suits a field annotated ``kind`` (a list only a list field, an
    int only a number field...); an annotation it cannot read accepts anything."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return any(_fits(value, k) for k in _options(kind))
    origin = typing.get_origin(kind)
    if origin in (list, tuple) or kind in (list, tuple):
        return isinstance(value, (list, tuple))
    if origin is dict or kind is dict:
        return isinstance(value, dict)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind in (int, str, bool):
        return type(value) is kind
    return True


def _required(field) -> bool:
    return field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING


def _is_config_class(kind) -> bool:
    return isinstance(kind, type) and dataclasses.is_dataclass(kind)


def _modules_of(cls) -> list:
    """The modules that define ``cls`` and its bases (where the code reading it lives)."""
    import sys

    found = []
    for base in getattr(cls, "__mro__", [cls]):
        module = sys.modules.get(getattr(base, "__module__", ""))
        if module is not None and module.__name__.startswith("mlx_lm.") and module not in found:
            found.append(module)
    return found


def _text_class(module, kind):
    """The config class a ``text_config`` dict becomes: the dataclass its annotation names
    (``Union[TextArgs, dict]``), else the one whose ``from_dict`` the model's code calls on
    ``text_config`` (``lfm2.ModelArgs.from_dict(args.text_config)``), searched in the modules
    of ``ModelArgs``, ``Model`` and their bases; None if neither is found."""
    import inspect
    import re

    for option in _options(kind):
        if _is_config_class(option):
            return option
    call = re.compile(r"([A-Za-z_][\w.]*)\.from_dict\(\s*(?:\w+\.)?text_config\b")
    for source in _modules_of(module.ModelArgs) + _modules_of(module.Model):
        try:
            text = inspect.getsource(source)
        except (OSError, TypeError):
            continue
        for dotted in call.findall(text):
            target = source
            for part in dotted.split("."):
                target = getattr(target, part, None)
            if _is_config_class(target):
                return target
    return None


def _variant(name: str):
    """A SIZES key that ``name`` qualifies: ``swa_head_dim`` (a prefix word before a key),
    ``vocab_size_per_layer_input`` (words after one). Only compound keys (``head_dim``,
    not ``dim``), so ``rotary_dim`` is not read as a model width."""
    words = name.split("_")
    for i in range(1, len(words)):
        for key in ("_".join(words[i:]), "_".join(words[:i])):
            if "_" in key and key in SIZES and not isinstance(SIZES[key], (list, tuple, dict)):
                return key
    return None


def _zero(kind):
    """A per-layer list's element when nothing names it: off (0, 0.0, False, "")."""
    return {int: 0, float: 0.0, bool: False, str: ""}.get(kind, None)


def _required_value(name: str, kind):
    """A value for a required field no SIZES entry names (``_MISSING`` if none is derived)."""
    options = _options(kind)
    kind = options[0] if options else kind
    origin = typing.get_origin(kind)
    numeric = kind in (int, float)
    if (key := _variant(name)) is not None and _fits(SIZES[key], kind):
        return SIZES[key]
    if origin in (list, tuple) or kind in (list, tuple):  # per layer, one entry each
        element = (typing.get_args(kind) or (None,))[0]
        key = name[len("layer_"):] if name.startswith("layer_") else name
        value = SIZES[key] if key in SIZES and _fits(SIZES[key], element) else _zero(element)
        return [value] * LAYERS if value is not None else _MISSING
    if numeric and (name.endswith("_idx") or name.endswith("_index")):
        return 0  # an index into something of its own: the first
    if kind is int and name.startswith("num_") and name.endswith("_layers"):
        return 1  # a count of layers of some kind: one of the two
    if kind is float and name.endswith(("_eps", "_epsilon")):
        return SIZES["rms_norm_eps"]
    if numeric and name.endswith(("_factor", "_pct", "_ratio", "_multiplier")):
        return kind(1)  # a fraction or scale of something sized above: all of it
    if name == "rope_parameters" and (kind is dict or origin is dict):
        return {"rope_theta": SIZES["rope_theta"], "rope_type": "default"}
    if kind in BY_TYPE:
        return BY_TYPE[kind]
    if origin is dict or kind is dict:
        return {}
    return _MISSING


_MISSING = object()


def _per_layer_class(cls, name: str):
    """``block_configs`` -> the ``BlockConfig`` dataclass of ``cls``'s modules, if any."""
    if not name.endswith("_configs"):
        return None
    wanted = name[:-1].replace("_", "")  # block_config -> blockconfig
    for module in _modules_of(cls):
        for value in vars(module).values():
            if _is_config_class(value) and value.__name__.lower() == wanted:
                return value
    return None


def derive(cls, model_type: str) -> dict:
    """A small config for the dataclass ``cls`` (a ``ModelArgs``, or a config nested in one):
    SIZES by field name (default or not), nested config dataclasses derived the same way
    (``text_config``; a required field annotated with one; ``block_configs``, one per
    layer), then required fields by name and annotated type (``_required_value``)."""
    hints = typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}
    config = {}
    for field in dataclasses.fields(cls):
        name, kind = field.name, hints.get(field.name, field.type)
        nested = next((k for k in _options(kind) if _is_config_class(k)), None)
        if name == "model_type":
            config[name] = model_type
        elif name == "text_config":  # a wrapper: its language model's config
            config[name] = _text_config(cls, kind, model_type)
        elif name in SIZES and _fits(SIZES[name], kind):
            config[name] = SIZES[name]
        elif nested is not None and _required(field):
            config[name] = derive(nested, model_type)
        elif (per_layer := _per_layer_class(cls, name)) is not None:
            config[name] = [derive(per_layer, model_type) for _ in range(LAYERS)]
        elif _required(field) and (value := _required_value(name, kind)) is not _MISSING:
            config[name] = value
    return config


def _text_config(cls, kind, model_type: str) -> dict:
    """A wrapper's ``text_config``: derived from the class the model reads it into (and that
    module's OVERRIDES when it is another architecture's ``ModelArgs``), else every scalar
    SIZES entry (its ``from_dict`` keeps the fields it knows)."""
    import sys

    text = _text_class(sys.modules[cls.__module__], kind)
    if text is None:
        config = {k: v for k, v in SIZES.items() if not isinstance(v, (list, tuple))}
        config["model_type"] = model_type
        return config
    config = derive(text, model_type)
    config.setdefault("model_type", model_type)
    if text.__name__ == "ModelArgs" and text.__module__ != cls.__module__:  # lfm2-vl reads lfm2's
        _refine(config, OVERRIDES.get(text.__module__.rsplit(".", 1)[-1], {}))
    return config


def _refine(config: dict, override: dict) -> None:
    """Apply an OVERRIDES entry: a dict given for ``text_config`` refines the derived one,
    anything else replaces the field."""
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict) and key == "text_config":
            _refine(config[key], value)
        else:
            config[key] = value


def tiny_args(name: str) -> dict:
    """A small config for architecture ``name``, derived from its ``ModelArgs``."""
    module = importlib.import_module(f"mlx_lm.models.{name}")
    config = derive(module.ModelArgs, name)
    _refine(config, OVERRIDES.get(name, {}))
    return config


def build(name: str, *, seed: int = 0, config: dict | None = None):
    """The random tiny model of ``name`` in float32 (``config``: its ModelArgs, default
    ``tiny_args(name)``)."""
    module = importlib.import_module(f"mlx_lm.models.{name}")
    args = module.ModelArgs.from_dict(tiny_args(name) if config is None else config)
    mx.random.seed(seed)
    model = module.Model(args)
    model.set_dtype(mx.float32)
    # Parameters initialised to zero (an output projection, attention sinks, gates) would make
    # a path trivial: attention that cannot change the logits tests nothing. Draw them instead.
    from mlx.utils import tree_flatten

    zero = [(k, v) for k, v in tree_flatten(model.parameters())
            if mx.issubdtype(v.dtype, mx.floating) and not bool(mx.any(v != 0))]
    if zero:
        model.load_weights([(k, 0.05 * mx.random.normal(v.shape)) for k, v in zero], strict=False)
    mx.eval(model.parameters())
    return model


def _run(model, prompt: list, steps: int, *, forced: list | None = None):
    """Logits [1 + steps, vocab] of a prefill and ``steps`` decode steps through the
    model's prompt cache (whatever ``make_prompt_cache`` gives), greedy or ``forced``."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[0, -1]
    out, tokens = [logits], []
    for i in range(steps):
        token = int(mx.argmax(out[-1])) if forced is None else forced[i]
        tokens.append(token)
        out.append(model(mx.array([[token]]), cache=cache)[0, -1])
    got = mx.stack(out).astype(mx.float32)
    mx.eval(got)
    return np.array(got), tokens


def _generate_step_tokens(model, prompt: list, steps: int) -> list:
    from mlx_lm.generate import generate_step

    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=steps,
                                             sampler=lambda lp: mx.argmax(lp, axis=-1))]


def _not_built(exc: Exception) -> str:
    text = str(exc).splitlines()[0][:160] if str(exc) else ""
    reason = f"tiny model not built: {type(exc).__name__}: {text}"
    if "[metal_kernel] No Metal back-end" in text:  # mx.fast.metal_kernel, called with no other path
        reason += " (its code runs a custom Metal kernel unconditionally: it cannot run without Metal)"
    return reason


def check(name: str, *, steps: int = DECODE_STEPS, seed: int = 0, config: dict | None = None) -> Row:
    """One architecture: build, refuse or compare (see the module docstring); ``config``:
    its ModelArgs, default ``tiny_args(name)``."""
    from .. import use_backend
    from .mlx_lm import UnsupportedModel, analyse_model, use_paged_cache

    start = time.perf_counter()
    row = Row(name, "unbuilt")
    try:
        model = build(name, seed=seed, config=config)
    except SystemExit as exc:  # olmo's module exits when its optional dependency is missing
        row.reason = f"module not importable: {exc}"
        row.seconds = time.perf_counter() - start
        return row
    except Exception as exc:
        row.reason = _not_built(exc)
        row.seconds = time.perf_counter() - start
        return row
    try:
        vocab = min(VOCAB, int(model(mx.array([[0]]))[0, -1].shape[-1]))
    except Exception as exc:
        row.reason = _not_built(exc)
        row.seconds = time.perf_counter() - start
        return row
    prompt = [int(t) for t in np.random.default_rng(seed).integers(1, vocab, PROMPT_TOKENS)]
    _mark(name, "reference")
    with use_backend("cpu"):
        try:
            expected, tokens = _run(model, prompt, steps)
            expected_gen = _generate_step_tokens(model, prompt, 8)
        except Exception as exc:
            row.reason = f"mlx-lm's own cache fails on the tiny model: {type(exc).__name__}: {str(exc)[:160]}"
            row.seconds = time.perf_counter() - start
            return row
        try:
            layout = analyse_model(model)
        except UnsupportedModel as exc:
            row.status, row.reason = "refused", str(exc).replace("[use_paged_cache] ", "", 1)
            row.seconds = time.perf_counter() - start
            return row
        row.paged_layers, row.native_layers = len(layout.specs), len(layout.native)
        row.head_dims = sorted({int(spec.head_dim) for spec in layout.specs})
        _mark(name, "paged")
        try:
            with use_paged_cache(model, block_size=16) as handle:
                got, got_tokens = _run(model, prompt, steps)
                row.gathered_calls = handle.shared_cache.gathered_attention
                got_gen = _generate_step_tokens(model, prompt, 8)
            with use_paged_cache(model, block_size=16, k_bits=8, v_bits=4):
                quant, _ = _run(model, prompt, steps, forced=tokens)
        except Exception as exc:
            row.status = "broken"
            row.reason = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            row.seconds = time.perf_counter() - start
            return row
    if not np.abs(expected).max() > 0:
        row.status, row.reason = "unbuilt", "the tiny model's logits are all zero: nothing to compare"
        row.seconds = time.perf_counter() - start
        return row
    scale = float(np.abs(expected).max())
    row.max_rel_diff = float(np.abs(got - expected).max() / scale) if np.isfinite(got).all() else float("inf")
    row.greedy_identical = got_tokens == tokens
    row.generate_step_identical = got_gen == expected_gen
    row.k8v4_finite = bool(np.isfinite(quant).all())
    row.k8v4_top1 = float((quant.argmax(-1) == expected.argmax(-1)).mean())
    problems = []
    if not row.max_rel_diff <= TOLERANCE:
        problems.append(f"logits differ (max rel {row.max_rel_diff:.2e} > {TOLERANCE:.0e})")
    if not row.greedy_identical:
        problems.append("greedy tokens differ")
    if not row.generate_step_identical:
        problems.append("generate_step tokens differ")
    if not row.k8v4_finite:
        problems.append("K8/V4 logits not finite")
    row.status = "broken" if problems else "exact"
    row.reason = "; ".join(problems)
    row.seconds = time.perf_counter() - start
    return row


def _worker_env() -> dict:
    """The worker imports the kvmetal this process imported: its folder goes first on
    PYTHONPATH and the worker runs outside any checkout (from a repository root, ``python -m``
    would find the uncompiled source tree before an installed wheel)."""
    import os
    from pathlib import Path

    import kvmetal

    home = str(Path(kvmetal.__file__).resolve().parent.parent)
    path = os.pathsep.join(p for p in (home, os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONFAULTHANDLER="", PYTHONPATH=path)


def sweep(names: list | None = None, *, timeout: float = 120.0) -> list:
    """``check`` every architecture in ``names`` (default: all), in a worker process that
    is restarted when one crashes or runs past ``timeout`` seconds (MLX's own CPU kernels
    segfault on a few tiny configs): a crash in mlx-lm's own run leaves the architecture
    unbuilt, a crash after kvmetal took over is broken."""
    import json
    import subprocess
    import sys
    import tempfile

    names = list(architectures() if names is None else names)
    rows, pending = [], list(names)
    while pending:
        worker = subprocess.Popen([sys.executable, "-m", "kvmetal.integrations.arch_sweep", "--worker"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                  text=True, env=_worker_env(), cwd=tempfile.gettempdir())
        worker.stdin.write("\n".join(pending) + "\n")
        worker.stdin.close()
        phase, current = None, None
        import selectors

        selector = selectors.DefaultSelector()
        selector.register(worker.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while True:
            if not selector.select(timeout=max(0.0, deadline - time.monotonic())):
                worker.kill()
                worker.wait()
                line = ""
                died = f"ran past {timeout:.0f} s"
            else:
                line = worker.stdout.readline()
                died = f"the worker process died (exit {worker.wait()})" if not line else None
            if died:
                if current is None:
                    return rows + [Row(n, "unbuilt", f"no result: {died}") for n in pending]
                status = "broken" if phase == "paged" else "unbuilt"
                where = "under use_paged_cache" if phase == "paged" else "in mlx-lm's own run of the tiny model"
                rows.append(Row(current, status, f"{died} {where}"))
                pending.remove(current)
                break
            if not line.startswith(_TAG):  # a model module printing something
                continue
            message = json.loads(line[len(_TAG):])
            if "phase" in message:
                phase, current = message["phase"], message["name"]
                if phase == "start":
                    deadline = time.monotonic() + timeout
            else:
                rows.append(Row(**message))
                pending.remove(message["name"])
                current = None
                if not pending:
                    worker.wait()
                    break
    order = {n: i for i, n in enumerate(names)}
    return sorted(rows, key=lambda r: order[r.name])


def _worker() -> None:
    import json
    import sys

    def report(**kwargs):
        sys.stdout.write(_TAG + json.dumps(kwargs) + "\n")
        sys.stdout.flush()

    global _phase
    _phase = lambda name, phase: report(name=name, phase=phase)  # noqa: E731
    for name in sys.stdin.read().split():
        report(name=name, phase="start")
        report(**check(name).as_dict())


_TAG = "@kvmetal-sweep "  # marks the worker's result lines among anything a module prints
_phase = None  # set in a sweep worker: reports which phase a check is in


def _mark(name: str, phase: str) -> None:
    if _phase is not None:
        _phase(name, phase)


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--worker"]:
        _worker()
