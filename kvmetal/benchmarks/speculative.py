"""Prompt-lookup speculation measured end to end (issue 34): the prompt sets and one run.

Two prompt sets, chat-templated, greedy: input-grounded (summarise or edit a given text,
continue or edit a given code file: the answer copies from the prompt) and open chat
(questions with no text to copy from). ``run`` generates for a set through the Engine,
with or without speculation, and returns wall time, tokens and the draft counters.
Used by ``bench/speculative.py`` (the study) and ``kvmetal bench -m --speculative``.
"""
from __future__ import annotations

import time
from pathlib import Path

TEXT = (
    "The city council met on Tuesday to discuss the new bicycle lanes on Main Street. Several residents "
    "said the lanes made the street safer for children who ride to school, while shop owners worried that "
    "the loss of parking spaces would keep customers away. The council agreed to count the number of "
    "cyclists and cars every week for three months and to ask the shop owners how their sales change. "
    "A final decision will be made in the spring, after the results are published on the city website."
)
TEXT_TYPOS = TEXT.replace("residents", "residnets").replace("customers", "custmers").replace(
    "decision", "decison").replace("published", "publishd")
NOTES = (
    "Meeting notes. Attendees: Anna, Ben, Carla. Anna presented the quarterly budget: spending on servers "
    "rose by ten percent, spending on travel fell by half. Ben asked whether the new storage system will "
    "be ready in March; Carla said the vendor promised delivery by the end of February. Action items: Anna "
    "sends the budget to the board, Ben tests the storage system, Carla schedules the next meeting."
)
CODE = Path(__file__).resolve().parents[1].joinpath("integrations", "table_mirror.py").read_text()
CODE = CODE[:1800]

GROUNDED = [
    f"Summarize the following text in three sentences.\n\n{TEXT}",
    f"Fix the spelling mistakes in the following text and write it out in full.\n\n{TEXT_TYPOS}",
    f"Rewrite the following notes as a bulleted list, keeping every detail.\n\n{NOTES}",
    f"Continue the following Python file.\n\n{CODE}",
    f"Repeat the following Python code, adding a comment above every method.\n\n{CODE[:1200]}",
    f"Who sends the budget to the board, and what does Ben test? Quote the notes.\n\n{NOTES}",
    f"Rewrite the following text in the past tense.\n\n{TEXT}",
    f"Explain what the following code does, function by function.\n\n{CODE[:1200]}",
]
OPEN_CHAT = [
    "Write a short story about a dragon who learns to bake bread.",
    "What are the main benefits of regular exercise?",
    "Explain how a rainbow forms.",
    "Give me five ideas for a birthday party for a ten-year-old.",
    "Why is the sky blue?",
    "Write a poem about the ocean at night.",
    "What should I pack for a week-long hiking trip?",
    "Describe the life cycle of a butterfly.",
]


EXTRA = [  # with the 16 above: the 20 prompts of the greedy identity run (--identity)
    f"Translate the following text into simple English, sentence by sentence.\n\n{NOTES}",
    f"List every number that appears in the following text.\n\n{TEXT}",
    "How do airplanes stay in the air?",
    "Write a short letter inviting a friend to dinner.",
]


def encode(tokenizer, prompt: str) -> list:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True))


def run(model, tokenizer, prompts: list, *, spec, streams: int, max_tokens: int) -> dict:
    """Generate for ``prompts``, ``streams`` at a time; wall time, tokens and counters."""
    from kvmetal.engine.engine import Engine

    outputs, seconds, prefill = [], 0.0, 0.0
    drafted = accepted = passes = decode_tokens = 0
    with Engine(model, speculative=spec, tokenizer=tokenizer) as engine:
        for start in range(0, len(prompts), streams):
            group = prompts[start:start + streams]
            begin = time.perf_counter()
            ids = [engine.add_request(p, max_tokens=max_tokens) for p in group]
            out = {i: [] for i in ids}
            started = None  # when every request of the group had its first token
            while engine.has_work():
                for event in engine.step():
                    if event.token is not None:
                        out[event.request_id].append(event.token)
                if started is None and all(out.values()):
                    started = time.perf_counter()
            seconds += time.perf_counter() - begin
            prefill += started - begin
            outputs += [out[i] for i in ids]
        drafted, accepted = engine.drafted_tokens, engine.accepted_tokens
        passes, decode_tokens = engine.decode_passes, engine.decode_tokens
    tokens = sum(len(o) for o in outputs)
    return {"outputs": outputs, "seconds": seconds, "tokens": tokens, "prefill_seconds": prefill,
            "decode_tokens_per_s": (tokens - len(outputs)) / (seconds - prefill),
            "drafted": drafted, "accepted": accepted,
            "decode_passes": passes, "decode_tokens": decode_tokens}


def compare(model, tokenizer, *, max_tokens: int, spec=None, streams: int = 1) -> list:
    """Plain vs speculative on both prompt sets, ``streams`` at a time: one row per set."""
    from ..engine.proposers import SpeculativeConfig

    spec = spec or SpeculativeConfig()
    rows = []
    for name, prompts in (("grounded", GROUNDED), ("open chat", OPEN_CHAT)):
        ids = [encode(tokenizer, p) for p in prompts]
        plain = run(model, tokenizer, ids, spec=None, streams=streams, max_tokens=max_tokens)
        fast = run(model, tokenizer, ids, spec=spec, streams=streams, max_tokens=max_tokens)
        rows.append({"prompts": name, "streams": streams,
                     "plain_tokens_per_s": plain["tokens"] / plain["seconds"],
                     "speculative_tokens_per_s": fast["tokens"] / fast["seconds"],
                     "acceptance_rate": fast["accepted"] / fast["drafted"] if fast["drafted"] else 0.0,
                     "tokens_per_pass": fast["decode_tokens"] / max(fast["decode_passes"], 1),
                     "greedy_identical": sum(a == b for a, b in zip(plain["outputs"], fast["outputs"])),
                     "requests": len(ids)})
    return rows
