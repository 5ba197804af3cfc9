"""``kvmetal serve`` and ``kvmetal generate`` on a tiny random llama4 (chunked attention:
three layers of four see only their own chunk of 16 tokens), saved as a model directory
(``tiny.build_arch_dir``): chat prompts of 45 and 113 tokens cross several chunk starts,
greedy answers equal mlx-lm's own, and two concurrent requests get what each gets alone."""
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

MESSAGES = [[{"role": "user", "content": "What is the capital of France? Write a short poem about the sea, "
                                         "and say when you do not know."}],
            [{"role": "system", "content": "You are a helpful assistant. Answer the question briefly and say "
                                           "when you do not know."},
             {"role": "user", "content": "Summarize the following text in one sentence, keeping the numbers "
                                         "that matter most: servers batch many requests in one forward pass."}]]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_arch_dir(tmp_path_factory.mktemp("llama4"), "llama4")


def mlx_lm_answer(path, messages):
    """mlx-lm's own greedy generation (its own caches, no kvmetal) of the chat prompt."""
    from mlx_lm import load, stream_generate

    model, tokenizer = load(str(path))
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert len(ids) > 2 * 16  # past two chunk starts
    return "".join(r.text for r in stream_generate(model, tokenizer, ids, max_tokens=MAX_TOKENS))


def test_greedy_chat_equals_mlx_lm_alone_and_together(model_dir):
    server = ServerProcess(model_dir, free_port(), "--log-level", "WARNING").start()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)

        def ask(messages):
            answer = client.chat.completions.create(model=str(model_dir), messages=messages, max_tokens=MAX_TOKENS,
                                                    temperature=0)
            return answer.choices[0].message.content

        alone = [ask(m) for m in MESSAGES]
        with ThreadPoolExecutor(len(MESSAGES)) as pool:
            together = list(pool.map(ask, MESSAGES))
    finally:
        assert server.stop() == 0, server.output
    assert together == alone
    assert alone == [mlx_lm_answer(model_dir, m) for m in MESSAGES]
    assert alone[0] != alone[1]  # the two prompts are told apart (not a constant model)


def test_kvmetal_generate_runs_a_saved_llama4(model_dir, capsys):
    from kvmetal import cli

    messages = MESSAGES[0]
    assert cli.main(["generate", "-m", str(model_dir), "-p", messages[0]["content"], "--max-tokens",
                     str(MAX_TOKENS)]) == 0
    assert capsys.readouterr().out == mlx_lm_answer(model_dir, messages) + "\n"
