"""Issue 41, R1: MLX binds an input under 8 elements as `constant`, which changes the
compiled pipeline (its mangled name ends in "c"); the metal backend grows such inputs
(seq_lens, slot_of, prefix_lens, sinks, small block tables, partials) to 8 elements, so
batch 1-7 and batch 8+ run the same pipelines. Checked on the simulator, which builds
MLX's signature and name for every call."""
import mlx.core as mx
import numpy as np
import pytest

import kvmetal as kv
from kvmetal.backends import metal
from kvmetal.sim import kernel as sim_kernel

from kvcases import paged_attention_inputs


@pytest.fixture
def pipelines(monkeypatch):
    """kernel name -> {mangled pipeline name: names of the inputs bound `constant`} of
    the calls made while the fixture is live."""
    seen = {}
    original = sim_kernel.SimKernel._variant

    def record(self, specs, output_dtypes, template):
        hit = original(self, specs, output_dtypes, template)
        constant = tuple(s.name for s in specs if s.is_constant and not s.is_scalar)
        seen.setdefault(self.name, {})[hit[0]] = constant
        return hit

    monkeypatch.setattr(sim_kernel.SimKernel, "_variant", record)
    return seen


def test_small_inputs_are_grown_to_device_size():
    for shape in [(1,), (3,), (7,), (1, 3), (2, 2, 1), (0,), (0, 4)]:
        a = mx.ones(shape, dtype=mx.int32)
        b = metal._device_bound(a)
        assert b.size >= 8 and b.ndim == a.ndim and tuple(b.shape[1:]) == tuple(a.shape[1:]) or a.size == 0
        np.testing.assert_array_equal(np.array(b).reshape(-1)[:a.size], np.array(a).reshape(-1))
    big = mx.ones((8,), dtype=mx.int32)
    assert metal._device_bound(big) is big


def test_batch_1_to_9_run_one_pipeline_per_kernel(pipelines):
    rng = np.random.default_rng(41)
    q, kc, vc, tables, lens, sinks = paged_attention_inputs(
        rng, lens=tuple(int(n) for n in rng.integers(1, 40, 9)), num_kv_heads=1, gqa=2, head_dim=64, block_size=16,
        dtype=mx.float16, use_sinks=True)
    with kv.use_backend("sim"):
        for batch in range(1, 10):
            out = kv.paged_attention(q[:batch], kc, vc, tables[:batch], lens[:batch], sinks=sinks)
            mx.eval(out)
            kc2, vc2 = kv.reshape_and_cache(mx.zeros((batch, 1, 64), mx.float16), mx.zeros((batch, 1, 64), mx.float16),
                                            kc, vc, mx.arange(batch, dtype=mx.int32))
            mx.eval(kc2, vc2)
    assert pipelines, "no kernel ran"
    for name, names in pipelines.items():
        assert len(names) == 1, f"{name}: batch 1-9 ran {len(names)} pipelines: {names}"
        assert not any(names.values()), (name, names)


def test_cascade_and_varlen_bind_no_constant_buffers(pipelines):
    rng = np.random.default_rng(7)
    q, kc, vc, tables, lens, sinks = paged_attention_inputs(
        rng, lens=(20, 3), num_kv_heads=1, gqa=2, head_dim=64, block_size=16, dtype=mx.float16, use_sinks=True)
    with kv.use_backend("sim"):
        out = kv.paged_attention_cascade(q, kc, vc, tables[:1], lens[:1], mx.array([0, -1], mx.int32), tables,
                                         mx.array([2, 3], mx.int32), sinks=sinks)
        qv = mx.concatenate([q, q, q, q, q, q], axis=0)[:10]
        out2 = kv.paged_attention_varlen(qv, kc, vc, tables[:1], lens[:1], mx.array([0, 10], mx.int32), sinks=sinks)
        mx.eval(out, out2)
    assert any("cascade_reduce" in n for n in pipelines) and any("paged_varlen_partials" in n for n in pipelines)
    for name, names in pipelines.items():
        assert not any(names.values()), (name, names)
