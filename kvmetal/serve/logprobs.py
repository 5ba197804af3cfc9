"""Engine ``TokenLogprobs`` -> the ``logprobs`` objects of OpenAI responses.

Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...], "id"}]}``
(``id``, the token id, is what mlx_lm.server's entries carry). Completions: the legacy
``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``.
A token's text is its own decoding (a token that ends inside a UTF-8 character decodes
to U+FFFD); ``bytes`` are that text's UTF-8 bytes.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    """One generated token with its logprobs and where its text starts in the output."""

    token: int
    logprob: float
    top: tuple  # ((token id, logprob), ...), most likely first
    text_offset: int


class LogprobsFormatter:
    """Formats ``Entry`` lists for one response kind; remembers token texts it decoded."""

    def __init__(self, tokenizer, *, chat: bool, top: int):
        self.tokenizer, self.chat, self.top = tokenizer, chat, top
        self._texts: dict = {}

    def text(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self.tokenizer.decode([token])
        return text

    def _chat_item(self, token: int, logprob: float) -> dict:
        text = self.text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8")), "id": token}

    def _top_dict(self, top: tuple) -> dict:
        out: dict = {}
        for token, logprob in top:  # most likely first: it keeps a text that two tokens share
            out.setdefault(self.text(token), logprob)
        return out

    def format(self, entries: list) -> dict:
        if self.chat:
            return {"content": [dict(self._chat_item(e.token, e.logprob),
                                     top_logprobs=[self._chat_item(t, lp) for t, lp in e.top]) for e in entries]}
        return {"tokens": [self.text(e.token) for e in entries],
                "token_logprobs": [e.logprob for e in entries],
                # a dict per token, as in OpenAI's legacy API
                "top_logprobs": [self._top_dict(e.top) for e in entries] if self.top else None,
                "text_offset": [e.text_offset for e in entries]}
