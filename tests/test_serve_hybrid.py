"""``kvmetal serve`` and ``kvmetal generate`` on a tiny random MoE (qwen3_moe) and a tiny
random hybrid (qwen3_next: gated-delta recurrent layers beside attention, MoE MLPs), saved
as model directories (``tiny.build_arch_dir``): greedy answers equal mlx-lm's own, and two
concurrent requests of different lengths get what each gets alone."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from kvmetal.serve.server import ServerProcess  # noqa: E402
from kvmetal.serve.tiny import build_arch_dir  # noqa: E402

from kvcases import free_port  # noqa: E402

MESSAGES = [[{"role": "user", "content": "What is the capital of France?"}],
            [{"role": "system", "content": "You are a helpful assistant. Answer the question briefly."},
             {"role": "user", "content": "Write a short poem about the sea, and say when you do not know."}]]
MAX_TOKENS = 12


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_next"])
def served(request, tmp_path_factory):
    path = build_arch_dir(tmp_path_factory.mktemp(request.param), request.param)
    server = ServerProcess(path, free_port(), "--log-level", "WARNING").start()
    yield path, server
    assert server.stop() == 0, server.output


def mlx_lm_answer(path, messages):
    """mlx-lm's own greedy generation (its own caches, no kvmetal) of the chat prompt."""
    from mlx_lm import load, stream_generate

    model, tokenizer = load(str(path))
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return "".join(r.text for r in stream_generate(model, tokenizer, ids, max_tokens=MAX_TOKENS))


def test_greedy_chat_equals_mlx_lm_alone_and_together(served):
    path, server = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def ask(messages):
        answer = client.chat.completions.create(model=str(path), messages=messages, max_tokens=MAX_TOKENS,
                                                temperature=0)
        return answer.choices[0].message.content

    alone = [ask(m) for m in MESSAGES]
    with ThreadPoolExecutor(len(MESSAGES)) as pool:
        together = list(pool.map(ask, MESSAGES))
    assert together == alone
    assert alone == [mlx_lm_answer(path, m) for m in MESSAGES]
    assert alone[0] != alone[1]  # the two prompts are told apart (not a constant model)


def test_kvmetal_generate_runs_a_saved_hybrid(tmp_path, capsys):
    from kvmetal import cli

    path = build_arch_dir(tmp_path / "qwen3_next", "qwen3_next")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert cli.main(["generate", "-m", str(path), "-p", messages[0]["content"], "--max-tokens",
                     str(MAX_TOKENS)]) == 0
    assert capsys.readouterr().out == mlx_lm_answer(path, messages) + "\n"
