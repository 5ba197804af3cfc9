"""OpenAI request bodies -> validated generation parameters, and OpenAI-style errors.

Field names and defaults follow ``mlx_lm.server`` where they overlap (``max_tokens`` or
``max_completion_tokens``, ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``,
``stop``, ``stream``, ``stream_options``, ``logprobs`` / ``top_logprobs``, the penalties
and their context sizes, ``logit_bias``, ``xtc_probability`` / ``xtc_threshold``,
``tools``, ``role_mapping``, ``chat_template_kwargs``), and kvmetal's own ``priority`` and
``speculative`` (false: no speculative decoding for this request). Types are strict: ``true`` is
not a number. Fields that would change the answer and that kvmetal cannot honour
(``n`` > 1, ``best_of``, ``echo``, ``suffix``, a structured ``response_format``,
``adapters``) are rejected rather than silently ignored; fields it does not know are
ignored, as OpenAI-compatible servers do.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..engine.sampler import SamplingParams
from ..seeds import SEED_RANGE_TEXT, is_seed


class APIError(Exception):
    """An error the client caused or must see: becomes ``{"error": {...}}`` with ``status``."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.param, self.type, self.code = status, param, type_, code
        self.headers = headers or {}  # e.g. Retry-After on a 429

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Defaults:
    """Server-side defaults (the ``--max-tokens``, ``--temp``... flags)."""

    max_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0


@dataclass
class GenerationRequest:
    """What one HTTP request asks the engine for (before tokenization of the prompt)."""

    chat: bool
    prompt: object  # completions: str or list of token ids; chat: list of messages
    max_tokens: int
    max_tokens_given: bool
    sampling: SamplingParams
    stop: list = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    chat_template_kwargs: dict = field(default_factory=dict)
    logprobs: int | None = None  # top alternatives to report per token (0: the chosen token's only)
    tools: list | None = None  # passed to the chat template
    role_mapping: dict | None = None  # prompt format when the tokenizer has no chat template
    priority: int = 0  # lower is served first, under a scheduling policy that reads it (vLLM's field)
    speculative: bool = True  # False: no speculative decoding for this request (when the server has it)


# What a chat with a model that has no chat template also stops at (kvmetal/serve/app.py,
# with_default_stop; and a line for every other role the messages use): its prompt is
# "role: content" lines, and a base model goes on to write the next turns itself.
PLAIN_CHAT_STOP = ("\nuser:", "\nassistant:")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _get(body: dict, name: str, check, what: str, default):
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise APIError(f"'{name}' must be {what}, got {value!r}", param=name)
    return value


UNSUPPORTED = {  # field -> (the values that mean "off", why it is refused)
    "n": ((None, 1), "one choice per request; send n requests (with different seeds) instead"),
    "best_of": ((None, 1), "one choice per request"),
    "echo": ((None, False), "the prompt is not echoed"),
    "suffix": ((None, ""), "no insertion after a suffix"),
    "response_format": ((None, {"type": "text"}), "no constrained (JSON) decoding"),
    "adapters": ((None,), "the served model is fixed at start"),
}
MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat (mlx_lm.server allows 11)


def _is_finite(v) -> bool:
    try:
        return _is_number(v) and math.isfinite(v)
    except OverflowError:  # an int too large for a float
        return False


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many top alternatives to report per token; None: no logprobs.

    Chat: ``logprobs`` (bool) and ``top_logprobs``. Completions: ``logprobs`` is the
    count (OpenAI), or a bool with ``top_logprobs`` (mlx_lm.server's form). As in
    mlx_lm.server, ``top_logprobs`` > 0 alone turns them on; -1 means none."""
    top = _get(body, "top_logprobs", lambda v: _is_int(v) and (v == -1 or 0 <= v <= MAX_TOP_LOGPROBS),
               f"an integer in [0, {MAX_TOP_LOGPROBS}] (or -1)", -1)
    if chat:
        on = _get(body, "logprobs", lambda v: isinstance(v, bool), "a boolean", False)
    else:
        on = _get(body, "logprobs", lambda v: isinstance(v, bool) or (_is_int(v) and 0 <= v <= MAX_TOP_LOGPROBS),
                  f"a boolean or an integer in [0, {MAX_TOP_LOGPROBS}]", False)
        if not isinstance(on, bool):
            return on
    if on:
        return max(top, 0)
    return top if top > 0 else None


def _logit_bias(body: dict) -> dict:
    bias = _get(body, "logit_bias", lambda v: isinstance(v, dict), "an object of token id -> bias", {})
    out = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.strip().isdigit() else None
        if token is None or not _is_finite(value):
            raise APIError(f"'logit_bias' must map token ids (as strings) to numbers, got {key!r}: {value!r}",
                           param="logit_bias")
        out[token] = float(value)
    return out


def _penalties(body: dict) -> dict:
    """mlx_lm.server's penalty fields (0: off) and context sizes (default 20)."""
    out = {"repetition_penalty": float(_get(body, "repetition_penalty", lambda v: _is_finite(v) and v >= 0,
                                            "a number >= 0", 0.0))}
    for name in ("presence_penalty", "frequency_penalty"):
        out[name] = float(_get(body, name, _is_finite, "a finite number", 0.0))
    for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
        out[name] = _get(body, name, lambda v: _is_int(v) and v >= 0, "an integer >= 0", 20)
    return out


def _chat_extras(body: dict) -> tuple:
    tools = _get(body, "tools", lambda v: isinstance(v, list) and all(isinstance(t, dict) for t in v),
                 "a list of objects", None)
    mapping = _get(body, "role_mapping", lambda v: isinstance(v, dict) and all(
        isinstance(k, str) and isinstance(x, str) for k, x in v.items()), "an object of strings", None)
    return tools or None, mapping


def parse(body, *, chat: bool, defaults: Defaults) -> GenerationRequest:
    """Validate a /v1/completions (``chat=False``) or /v1/chat/completions body."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    for name, (off, why) in UNSUPPORTED.items():
        if name in body and body[name] not in off:
            raise APIError(f"'{name}' = {body[name]!r} is not supported by kvmetal serve: {why}", param=name)
    if chat:
        prompt = body.get("messages")
        if not isinstance(prompt, list) or not prompt:
            raise APIError("'messages' must be a non-empty list of {role, content} objects", param="messages")
        for i, m in enumerate(prompt):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise APIError(f"messages[{i}] must be an object with a string 'role'", param="messages")
            m["content"] = _message_text(m.get("content"), i)
        tools, role_mapping = _chat_extras(body)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        ok = (isinstance(prompt, str) and prompt) or (
            isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt))
        if not ok:
            raise APIError("'prompt' must be a non-empty string or a non-empty list of token ids "
                           "(one prompt per request)", param="prompt")
        tools, role_mapping = None, None
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _get(body, name, lambda v: _is_int(v) and v >= 1, "an integer >= 1", None)
    given = max_tokens is not None
    max_tokens = defaults.max_tokens if max_tokens is None else max_tokens
    temperature = _get(body, "temperature", lambda v: _is_finite(v) and v >= 0, "a finite number >= 0",
                       defaults.temperature)
    top_p = _get(body, "top_p", lambda v: _is_number(v) and 0 <= v <= 1, "a number in [0, 1]", defaults.top_p)
    top_k = _get(body, "top_k", lambda v: _is_int(v) and v >= 0, "an integer >= 0", defaults.top_k)
    min_p = _get(body, "min_p", lambda v: _is_number(v) and 0 <= v <= 1, "a number in [0, 1]", defaults.min_p)
    seed = _get(body, "seed", is_seed, SEED_RANGE_TEXT, None)  # at any temperature
    stream = _get(body, "stream", lambda v: isinstance(v, bool), "a boolean", False)
    options = _get(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise APIError("'stream_options.include_usage' must be a boolean", param="stream_options")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise APIError("'stop' must be a non-empty string or a list of them", param="stop")
    template_kwargs = _get(body, "chat_template_kwargs", lambda v: isinstance(v, dict), "an object", {})
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError(f"'model' must be a string, got {model!r}", param="model")
    xtc_probability = _get(body, "xtc_probability", lambda v: _is_number(v) and 0 <= v <= 1, "a number in [0, 1]",
                           0.0)
    xtc_threshold = _get(body, "xtc_threshold", lambda v: _is_number(v) and 0 <= v <= 0.5,
                         "a number in [0, 0.5]", 0.1)
    sampling = SamplingParams(temperature=float(temperature), top_p=float(top_p), top_k=top_k,
                              min_p=float(min_p), seed=seed, logit_bias=_logit_bias(body),
                              xtc_probability=float(xtc_probability), xtc_threshold=float(xtc_threshold),
                              **_penalties(body))
    return GenerationRequest(chat, prompt, max_tokens, given, sampling, stop, stream, include_usage,
                             template_kwargs, _logprobs(body, chat), tools, role_mapping,
                             _get(body, "priority", _is_int, "an integer", 0),
                             _get(body, "speculative", lambda v: isinstance(v, bool), "a boolean", True))


def _message_text(content, i: int) -> str | None:
    """A message's content as text (a string, or a list of {type: text} parts); None stays
    None (an assistant turn that only calls tools)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise APIError(f"messages[{i}].content must be a string, null or a list of text parts", param="messages")


def check_fits(prompt_tokens: int, req: GenerationRequest, *, max_prompt: int | None, max_total: int | None,
               context_limit: int | None) -> int:
    """The max_tokens to run with; APIError(400) with the numbers when it can never fit."""
    if max_prompt is not None and prompt_tokens > max_prompt:
        raise APIError(f"the prompt has {prompt_tokens} tokens; the KV cache cap holds at most {max_prompt} "
                       f"tokens of one request", param="messages" if req.chat else "prompt",
                       code="context_length_exceeded")
    limits = [x for x in (max_total, context_limit) if x is not None]
    limit = min(limits) if limits else None
    if limit is None:
        return req.max_tokens
    what = "the KV cache cap" if limit == max_total else "the model's context"
    if req.max_tokens_given:
        if prompt_tokens + req.max_tokens > limit:
            raise APIError(f"this request needs {prompt_tokens + req.max_tokens} tokens ({prompt_tokens} in the "
                           f"prompt, {req.max_tokens} to generate); {what} holds {limit} tokens of one request",
                           param="max_tokens", code="context_length_exceeded")
        return req.max_tokens
    room = limit - prompt_tokens
    if room < 1:
        raise APIError(f"the prompt has {prompt_tokens} tokens; {what} holds {limit} tokens of one request, "
                       f"leaving no room to generate", param="messages" if req.chat else "prompt",
                       code="context_length_exceeded")
    return min(req.max_tokens, room)
