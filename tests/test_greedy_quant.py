"""Greedy decode through a quantized KV cache (bench/greedy_study.py): K8/V4 keeps the float16 tokens."""
import importlib.util
import pathlib
import sys

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_lm")  # the study drives mlx-lm models; the package is in the `lm` extra

from kvmetal import quant

_PATH = pathlib.Path(__file__).resolve().parents[1] / "bench" / "greedy_study.py"
_spec = importlib.util.spec_from_file_location("greedy_study", _PATH)
study = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("greedy_study", study)   # dataclasses look their module up by name
_spec.loader.exec_module(study)

CONFIG = study.StudyConfig()   # the designed copy model, float16, 64 steps


@pytest.fixture(scope="module")
def setup():
    model = study.build_model(CONFIG)
    prompt = study.make_prompt(CONFIG)
    reference = study.decode_run(model, prompt, CONFIG, None, None)
    return model, prompt, reference


def test_reference_run_copies_the_prompt_confidently(setup):
    _, prompt, (tokens, logits) = setup
    p = np.array(prompt).tolist()
    assert tokens == [p[i % CONFIG.prompt_len] for i in range(CONFIG.steps)]
    top2 = np.sort(logits, axis=-1)[:, -2:]
    assert (top2[:, 1] - top2[:, 0]).min() > 3.0   # not a knife edge: a flip means real damage


def test_k8v4_greedy_tokens_equal_float16_over_64_steps(setup):
    model, prompt, reference = setup
    result = study.compare_format(model, prompt, CONFIG, "K8/V4", 8, 4, reference)
    assert result.tokens == reference[0]
    assert result.matches == 64 and result.first_divergence is None
    # teacher-forced logits stay close (the copied token leads by > 3)
    assert 0 < result.max_logit_err < 1.0


def test_low_bit_keys_do_break_greedy(setup):
    # The same check fails when K is too coarse for the key outlier: the test can fail.
    model, prompt, reference = setup
    result = study.compare_format(model, prompt, CONFIG, "K3/V3", 3, 3, reference)
    assert result.first_divergence is not None and result.matches < 64
    assert result.max_logit_err > 2.0


def test_study_cache_quantizes_every_row_written():
    cache = study.QuantizedStudyCache(k_bits=8, v_bits=4, group_size=64)
    k1, v1 = (mx.random.normal((1, 2, 5, 128), key=mx.random.key(i)).astype(mx.float16) for i in (1, 2))
    k2, v2 = (mx.random.normal((1, 2, 1, 128), key=mx.random.key(i)).astype(mx.float16) for i in (3, 4))
    cache.update_and_fetch(k1, v1)                      # prompt prefill: 5 rows
    keys, values = cache.update_and_fetch(k2, v2)       # one decode step
    assert cache.offset == 6 and keys.shape == values.shape == (1, 2, 6, 128)
    assert isinstance(cache.keys, quant.QuantizedKV) and (cache.keys.bits, cache.values.bits) == (8, 4)
    for got, rows, bits in ((keys, (k1, k2), 8), (values, (v1, v2), 4)):
        full = mx.concatenate(rows, axis=2)
        expected = quant.dequantize(quant.quantize(full, bits=bits, group_size=64))
        assert got.dtype == mx.float16
        assert mx.array_equal(got, expected).item()
        assert not mx.array_equal(got, full).item()      # really quantized, prompt rows included
    assert not hasattr(cache, "bits")   # mlx-lm would route a cache with `bits` to its own attention


def test_kvmetal_integration_agrees_with_the_study_cache(setup):
    """Cross-check: kvmetal's paged, quantized mlx-lm path gives the same K8/V4 decode."""
    pytest.importorskip("kvmetal._ext")  # the CPU backend's native extension
    model, prompt, reference = setup
    own = study.decode_run(model, prompt, CONFIG, 8, 4, forced=reference[0])
    paged = study.decode_run(model, prompt, CONFIG, 8, 4, path="kvmetal", forced=reference[0])
    assert paged[0] == own[0]
    np.testing.assert_allclose(paged[1], own[1], atol=0.1)


def test_study_command_prints_and_writes_the_table(tmp_path, capsys):
    out = tmp_path / "table.md"
    assert study.main(["--steps", "8", "--write", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.strip() == out.read_text().strip()
    assert "| K8/V4 | 8/8 | - |" in printed and "designed copy model" in printed
    with pytest.raises(ValueError, match=r"\[greedy_study\] model must be 'copy' or 'random'"):
        study.build_model(study.StudyConfig(model="trained"))
