"""bench/agent_sessions.py's workload, built without a server: seeded, growing, shared system prompt, round-robin."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))  # agent_sessions imports serve_load from beside it
    try:
        spec = importlib.util.spec_from_file_location("agent_sessions", BENCH / "agent_sessions.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


def test_workload_is_deterministic_by_seed(bench):
    a = bench.build_workload(3, 4, 4000, 16, seed=7)
    assert a == bench.build_workload(3, 4, 4000, 16, seed=7)
    assert a["users"] != bench.build_workload(3, 4, 4000, 16, seed=8)["users"]


def test_contexts_grow_to_the_target(bench):
    w = bench.build_workload(3, 4, 4000, 16, seed=0)
    for s in range(3):
        sizes = [bench.context_estimate(w, s, t) for t in range(4)]
        assert sizes == sorted(sizes) and len(set(sizes)) == 4
        assert 0.9 * 4000 <= sizes[-1] <= 1.1 * 4000
    answers = {(s, t): f"answer {s} {t}" for s in range(3) for t in range(4)}
    for s in range(3):  # each turn's chat extends the previous one (what prefix caching reuses)
        chats = [bench.messages(w, s, t, answers) for t in range(4)]
        for earlier, later in zip(chats, chats[1:]):
            assert later[:len(earlier)] == earlier and len(later) == len(earlier) + 2


def test_agent_shape_a_long_first_turn_then_short_steps(bench):
    w = bench.build_workload(3, 3, 6000, 16, seed=0, turn_tokens=200)
    for s in range(3):
        steps = w["user_tokens"][s]
        assert steps[0] > 4000 and all(190 <= n <= 230 for n in steps[1:]), steps
        assert 0.9 * 6000 <= bench.context_estimate(w, s, 2) <= 1.1 * 6000


def test_sessions_share_only_the_system_prompt(bench):
    w = bench.build_workload(4, 2, 3000, 16, seed=1)
    chats = [bench.messages(w, s, 0, {}) for s in range(4)]
    assert all(c[0] == {"role": "system", "content": w["system"]} for c in chats)
    assert 300 <= bench.word_count(w["system"]) <= 500
    firsts = [c[1]["content"] for c in chats]
    assert len(set(firsts)) == 4  # no two sessions start alike past the system prompt
    chunks = [text.split("\n\n", 1)[1] for texts in w["users"] for text in texts]
    assert len(set(chunks)) == len(chunks)  # no documentation chunk is reused


def test_round_robin_order(bench):
    order = bench.schedule(3, 2)
    assert order == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    gaps = {}
    for i, (s, _) in enumerate(order):  # every other session's turn runs between two turns of one session
        if s in gaps:
            assert i - gaps[s] == 3
        gaps[s] = i


def test_too_small_a_context_is_refused(bench):
    with pytest.raises(ValueError, match="for a user message"):
        bench.build_workload(2, 8, 500, 32, seed=0)


def test_answers_compared_with_hot(bench):
    turns = lambda answers: [{"session": 0, "turn": t, "answer": a} for t, a in enumerate(answers)]  # noqa: E731
    runs = {"hot": {"turns": turns("abc")}, "x": {"turns": turns("abd")}, "y": {"turns": turns("xbc")}}
    out = bench.compare_answers(runs)
    assert out["hot"] == {"equal": 3, "turns": 3, "equal_same_history": 3, "same_history": 3}
    assert out["x"] == {"equal": 2, "turns": 3, "equal_same_history": 2, "same_history": 3}
    assert out["y"] == {"equal": 2, "turns": 3, "equal_same_history": 0, "same_history": 1}
