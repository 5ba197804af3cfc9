"""Issue 41, P4's partials goal on the simulator: the decode partials' accumulator type
(template TP, metal_layout.partials_dtype). 16-bit (normalized by its sum) only where
the output is 16-bit and cannot overflow: half for a float16 output over a float16 V,
bfloat16 for a bfloat16 output; float32 (unnormalized, as before) everywhere else and
under KVMETAL_METAL_PARTIALS=float32."""
import mlx.core as mx
import numpy as np
import pytest

import kvmetal as kv
from kvmetal import quant
from kvmetal import reference as ref
from kvmetal import sim
from kvmetal.backends import metal_layout

from kvcases import assert_close, paged_attention_inputs

D, HKV, G = 64, 1, 4
TAGS = {mx.float16: "f16", mx.bfloat16: "bf16", mx.float32: "f32"}


def _expected(qdtype, vdtype, v_quant: bool):
    if qdtype == mx.bfloat16:
        return mx.bfloat16
    if qdtype == mx.float16 and vdtype == mx.float16 and not v_quant:
        return mx.float16
    return mx.float32


def _paged(qdtype, cdtype, *, v_quant=False, lens=(300, 40), seed=0):
    rng = np.random.default_rng(seed)
    q, kc, vc, tables, seq_lens, _ = paged_attention_inputs(
        rng, lens=lens, num_kv_heads=HKV, gqa=G, head_dim=D, block_size=16, dtype=cdtype, use_sinks=False)
    q = q.astype(qdtype)
    if v_quant:
        vc = quant.quantize(vc, bits=4, group_size=32)
    return q, kc, vc, tables, seq_lens


def _traced(fn):
    with sim.trace(strict=True, seed=0) as t, kv.use_backend("sim"):
        out = fn()
        mx.eval(out)
    return out, t.calls


@pytest.mark.parametrize("qdtype,cdtype,v_quant", [
    (mx.float16, mx.float16, False), (mx.float16, mx.float32, False), (mx.float16, mx.bfloat16, False),
    (mx.float16, mx.float16, True), (mx.bfloat16, mx.bfloat16, False), (mx.bfloat16, mx.float32, True),
    (mx.float32, mx.float32, False), (mx.float32, mx.float16, False)])
def test_partials_dtype_follows_the_rule(qdtype, cdtype, v_quant):
    q, kc, vc, tables, seq_lens = _paged(qdtype, cdtype, v_quant=v_quant)
    want = _expected(qdtype, cdtype, v_quant)
    assert metal_layout.partials_dtype(qdtype, vc) == want
    out, calls = _traced(lambda: kv.paged_attention(q, kc, vc, tables, seq_lens))
    partials = next(c for c in calls if "paged_attention_partials" in c.name)
    reduce = next(c for c in calls if "attention_reduce" in c.name)
    assert partials.name.endswith("_tp" + TAGS[want]), partials.name
    assert f"_tp{TAGS[want]}_" in reduce.name, reduce.name
    # Bytes stored per accumulator element: the type's size (the simulator counts bytes).
    splits = partials.grid[0] // partials.threadgroup[0]
    live = sum(-(-n // metal_layout.SPLIT_TOKENS) for n in (300, 40))
    assert splits == 2
    assert partials.buffers["part_acc"].stored == live * HKV * G * D * want.size
    assert partials.buffers["part_max"].stored == 2 * splits * HKV * G * 4  # m, l stay float32
    assert_close(out, ref.paged_attention(q, kc, vc, tables, seq_lens), qdtype)


def test_decode_and_cascade_partials_follow_the_rule():
    rng = np.random.default_rng(3)
    for qdtype, cdtype in ((mx.float16, mx.float16), (mx.float16, mx.float32), (mx.bfloat16, mx.float16)):
        want = TAGS[_expected(qdtype, cdtype, False)]
        q = mx.array(rng.standard_normal((2, HKV * G, 1, D)).astype(np.float32)).astype(qdtype)
        k, v = (mx.array(rng.standard_normal((2, HKV, 600, D)).astype(np.float32)).astype(cdtype) for _ in range(2))
        out, calls = _traced(lambda: kv.decode_attention(q, k, v))
        assert next(c for c in calls if "decode_attention_partials" in c.name).name.endswith("_tp" + want)
        assert f"_tp{want}_" in next(c for c in calls if "attention_reduce" in c.name).name
        assert_close(out, ref.decode_attention(q, k, v), qdtype)
        pq, kc, vc, tables, seq_lens = _paged(qdtype, cdtype, lens=(300, 300, 20), seed=4)
        prefix_of = mx.array([0, 0, -1], dtype=mx.int32)
        args = (pq, kc, vc, tables[:1], seq_lens[:1], prefix_of, tables[:, :1], mx.array([5, 9, 16], mx.int32))
        out, calls = _traced(lambda: kv.paged_attention_cascade(*args))
        names = [c.name for c in calls if "cascade_partials" in c.name]
        assert names and all(n.endswith("_tp" + want) for n in names), names
        assert f"_tp{want}_" in next(c for c in calls if "cascade_reduce" in c.name).name
        assert_close(out, ref.paged_attention_cascade(*args), qdtype)


def test_float32_setting_keeps_partials_float32(monkeypatch):
    q, kc, vc, tables, seq_lens = _paged(mx.float16, mx.float16)
    auto, calls = _traced(lambda: kv.paged_attention(q, kc, vc, tables, seq_lens))
    assert next(c for c in calls if "partials" in c.name).name.endswith("_tpf16")
    monkeypatch.setenv("KVMETAL_METAL_PARTIALS", "float32")
    assert metal_layout.partials_dtype(mx.bfloat16, vc) == mx.float32
    full, calls = _traced(lambda: kv.paged_attention(q, kc, vc, tables, seq_lens))
    assert next(c for c in calls if "partials" in c.name).name.endswith("_tpf32")
    want = ref.paged_attention(q, kc, vc, tables, seq_lens)
    assert_close(auto, want, mx.float16)
    assert_close(full, want, mx.float16)


@pytest.mark.parametrize("value", ["float16", "half", "AUTO", "1", " auto"])
def test_partials_setting_bad_values(monkeypatch, value):
    monkeypatch.setenv("KVMETAL_METAL_PARTIALS", value)
    with pytest.raises(ValueError, match="KVMETAL_METAL_PARTIALS"):
        metal_layout.partials_dtype(mx.float16, mx.zeros((1, 1, 1, 8), mx.float16))
    q, kc, vc, tables, seq_lens = _paged(mx.float16, mx.float16, lens=(20,))
    with pytest.raises(ValueError, match="KVMETAL_METAL_PARTIALS"), kv.use_backend("sim"):
        kv.paged_attention(q, kc, vc, tables, seq_lens)


def _huge_negligible_window(seq_len=608, huge=1.0e6):
    """A float16 query over a float32 cache: window 0 (tokens [0, 256)) holds V = huge
    (past half's 65504) under keys scored about 32 below the others (natural log units), so
    its weight is ~1e-14 and the output ~1; the other tokens are ordinary."""
    rng = np.random.default_rng(7)
    q = np.full((1, G, D), 0.5, np.float32)
    k = rng.standard_normal((1, HKV, seq_len, D)).astype(np.float32) * 0.1
    v = rng.standard_normal((1, HKV, seq_len, D)).astype(np.float32)
    window = metal_layout.SPLIT_TOKENS
    k[:, :, :window] = -8.0  # q . k * D ** -0.5 = 0.5 * -8 * 64 / 8 = -32
    v[:, :, :window] = huge
    blocks = seq_len // 16
    kc = mx.array(k.reshape(HKV, blocks, 16, D).transpose(1, 0, 2, 3))
    vc = mx.array(v.reshape(HKV, blocks, 16, D).transpose(1, 0, 2, 3))
    tables = mx.array(np.arange(blocks, dtype=np.int32)[None])
    return mx.array(q).astype(mx.float16), kc, vc, tables, mx.array([seq_len], mx.int32)


def test_float16_output_over_float32_v_stays_finite(monkeypatch):
    q, kc, vc, tables, seq_lens = _huge_negligible_window()
    assert metal_layout.partials_dtype(mx.float16, vc) == mx.float32
    want = ref.paged_attention(q, kc, vc, tables, seq_lens)
    out, calls = _traced(lambda: kv.paged_attention(q, kc, vc, tables, seq_lens))
    partials = next(c for c in calls if "partials" in c.name)
    assert partials.grid[0] // partials.threadgroup[0] == 3  # window 0 is a split of its own
    assert np.isfinite(np.array(out.astype(mx.float32))).all()
    assert_close(out, want, mx.float16)
    # The case is one the rule must catch: half partials there overflow to inf.
    monkeypatch.setattr(metal_layout, "partials_dtype", lambda qd, v: mx.float16)
    forced, _ = _traced(lambda: kv.paged_attention(q, kc, vc, tables, seq_lens))
    assert not np.isfinite(np.array(forced.astype(mx.float32))).all()
