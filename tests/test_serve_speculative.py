"""``kvmetal serve --speculative ngram`` through the official ``openai`` client (issue 34).

Greedy answers must be those of a server without speculation (completions and chat,
streamed and not), by prompt lookup and with a draft model; drafts must be accepted (``/metrics``), a request's
``"speculative": false`` must draft nothing, and bad values get 400 (body) or exit 2 (flags).
"""
from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from kvmetal.serve import metrics  # noqa: E402
from kvmetal.serve.server import ServerProcess  # noqa: E402
from kvmetal.serve.tiny import build_model_dir  # noqa: E402

from kvcases import free_port  # noqa: E402

TEXT = ("The paged cache keeps keys and values in fixed blocks. A block table maps every sequence "
        "to its blocks. The paged cache keeps keys and values in fixed blocks.")
PROMPTS = [f"Repeat after me: {TEXT} {i}" for i in range(3)] + ["Copy: one two three one two three one two"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("tiny-llama-spec"))


def answers(model_dir, *flags) -> tuple:
    """Greedy completions (streamed and not) and a chat of PROMPTS, and the server's metrics."""
    with ServerProcess(model_dir, free_port(), "--log-level", "WARNING", *flags) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        out = []
        for prompt in PROMPTS:
            out.append(client.completions.create(model=str(model_dir), prompt=prompt, max_tokens=40,
                                                 temperature=0).choices[0].text)
            stream = client.completions.create(model=str(model_dir), prompt=prompt, max_tokens=40,
                                               temperature=0, stream=True)
            out.append("".join(c.choices[0].text for c in stream if c.choices))
        out.append(client.chat.completions.create(model=str(model_dir), max_tokens=40, temperature=0,
                                                  messages=[{"role": "user", "content": PROMPTS[0]}]
                                                  ).choices[0].message.content)
        seen = metrics.parse(httpx.get(server.url + "/metrics").text)
        off = client.completions.create(model=str(model_dir), prompt=PROMPTS[0], max_tokens=40, temperature=0,
                                        extra_body={"speculative": False}).choices[0].text
        after = metrics.parse(httpx.get(server.url + "/metrics").text)
        with pytest.raises(openai.BadRequestError, match="'speculative' must be a boolean"):
            client.completions.create(model=str(model_dir), prompt="x", max_tokens=2,
                                      extra_body={"speculative": "yes"})
    return out, off, seen, after


def test_speculative_server_answers_as_the_plain_one(model_dir):
    plain, plain_off, plain_metrics, _ = answers(model_dir)
    spec, off, seen, after = answers(model_dir, "--speculative", "ngram", "--num-draft-tokens", "5",
                                     "--spec-min-acceptance", "0")
    assert spec == plain and off == plain_off == plain[0]
    assert plain_metrics["kvmetal_spec_draft_tokens"] == 0 and plain_metrics["kvmetal_decode_tokens_per_pass"] == 1
    assert seen["kvmetal_spec_accepted_tokens"] > 0 and seen["kvmetal_decode_tokens_per_pass"] > 1
    assert 0 < seen["kvmetal_spec_acceptance_rate"] <= 1
    assert after["kvmetal_spec_draft_tokens"] == seen["kvmetal_spec_draft_tokens"]  # "speculative": false
    # a draft model: the served model itself (same weights, so every draft is accepted)
    drafted, off, seen, _ = answers(model_dir, "--speculative", str(model_dir), "--spec-min-acceptance", "0")
    assert drafted == plain and off == plain[0]
    assert seen["kvmetal_spec_acceptance_rate"] == 1 and seen["kvmetal_decode_tokens_per_pass"] > 2, seen


def chat_logprobs(client, model_dir, prompt: str, **extra) -> list:
    """A greedy chat's (token, logprob, top logprobs) entries, as the server sent them."""
    reply = client.chat.completions.create(model=str(model_dir), max_tokens=40, temperature=0, logprobs=True,
                                           top_logprobs=3, messages=[{"role": "user", "content": prompt}],
                                           extra_body=extra or None)
    return [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs])
            for e in reply.choices[0].logprobs.content]


@pytest.mark.parametrize("flags", [["--kv-bits", "4", "--k-bits", "8"], ["--kv-bits", "8", "--kv-group-size", "64"]],
                         ids=["k8v4", "kv8-g64"])
def test_speculative_false_and_true_get_the_same_logprobs_from_a_quantized_cache(model_dir, flags):
    """Issue 44: one quantized server, each chat asked with ``"speculative": false`` and
    then with speculation: the same tokens and logprobs to the bit (8-bit K differed from
    the first verified draft on)."""
    with ServerProcess(model_dir, free_port(), "--log-level", "WARNING", *flags, "--speculative", "ngram",
                       "--ngram-min", "1", "--spec-min-acceptance", "0") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for prompt in PROMPTS:
            plain = chat_logprobs(client, model_dir, prompt, speculative=False)
            spec = chat_logprobs(client, model_dir, prompt)
            assert len(plain) > 10 and spec == plain, prompt
        seen = metrics.parse(httpx.get(server.url + "/metrics").text)
    assert seen["kvmetal_spec_accepted_tokens"] > 0, seen


@pytest.mark.parametrize("flags,message", [(["--num-draft-tokens", "8"], "--num-draft-tokens"),
                                           (["--speculative", "eagle"], "neither 'ngram' nor a model directory"),
                                           (["--speculative", "ngram", "--ngram-min", "4"], "--ngram-min 4 must be")])
def test_bad_speculative_flags_exit_2(model_dir, flags, message):
    # Run outside the source tree: from the repository root `-m kvmetal` would find the tree
    # (no built extension there) before the installed package.
    done = subprocess.run([sys.executable, "-m", "kvmetal", "serve", "--model", str(model_dir), *flags],
                          capture_output=True, text=True, timeout=120, cwd=model_dir)
    assert done.returncode == 2 and message in done.stderr, done.stderr
