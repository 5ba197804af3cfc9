"""Head dims 32, 48 and 72 (issue 40: models with small heads) through every op, against
the float64 oracles, on the cpu backend and the simulator (which runs the metal backend's
exact kernel calls). Quantized caches need a group size dividing head_dim: 32 takes K8/V4
at group 32; 48 and 72 have no supported group size, which KVFormat refuses by name."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import kvmetal as kv
from kvmetal import ops, quant, reference
from kvmetal.kv_format import KVFormat, KVFormatError

from kvcases import skip_unless_available

SMALL = (32, 48, 72)
BACKENDS = [pytest.param(b, marks=skip_unless_available(b)) for b in ("cpu", "sim")]


def _setup(head_dim, *, bits=None, seed=0):
    rng = np.random.default_rng(seed)
    n, hkv, bs, h = 12, 2, 16, 8
    kc = rng.standard_normal((n, hkv, bs, head_dim)).astype(np.float32)
    vc = rng.standard_normal((n, hkv, bs, head_dim)).astype(np.float32)
    tables = np.array([[3, 0, 7], [5, 9, 1]], dtype=np.int32)
    lens = np.array([40, 17], dtype=np.int32)
    k, v = mx.array(kc), mx.array(vc)
    if bits is not None:
        k, v = quant.quantize(k, bits=bits[0], group_size=32), quant.quantize(v, bits=bits[1], group_size=32)
        kc, vc = quant.dequantize_reference(k), quant.dequantize_reference(v)
    return rng, h, k, v, kc, vc, tables, lens


def _close(got, want, budget=1e-5):
    got = np.array(got, dtype=np.float64)
    assert np.abs(got - want).max() <= budget * max(1.0, np.abs(want).max())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", SMALL)
def test_attention_ops(backend, head_dim):
    rng, h, k, v, kc, vc, tables, lens = _setup(head_dim)
    with kv.use_backend(backend):
        q = rng.standard_normal((2, h, head_dim)).astype(np.float32)
        _close(ops.paged_attention(mx.array(q), k, v, mx.array(tables), mx.array(lens), softcap=5.0),
               reference.paged_attention(q, kc, vc, tables, lens, softcap=5.0))
        q4 = rng.standard_normal((2, 3, h, head_dim)).astype(np.float32)
        _close(ops.paged_attention(mx.array(q4), k, v, mx.array(tables), mx.array(lens), sliding_window=9),
               reference.paged_attention(q4, kc, vc, tables, lens, sliding_window=9))
        qsl = np.array([0, 11, 17], dtype=np.int32)
        qv = rng.standard_normal((17, h, head_dim)).astype(np.float32)
        _close(ops.paged_attention_varlen(mx.array(qv), k, v, mx.array(tables), mx.array(lens), mx.array(qsl)),
               reference.paged_attention_varlen(qv, kc, vc, tables, lens, qsl))
        keys, values = ops.gather_kv_cache(k, v, mx.array(tables), mx.array(lens), max_len=40)
        _close(keys, reference.gather_kv_cache(kc, vc, tables, lens, max_len=40)[0], 0)
        qd = rng.standard_normal((2, h, 2, head_dim)).astype(np.float32)
        _close(ops.decode_attention(mx.array(qd), keys, values),
               reference.decode_attention(qd, np.array(keys), np.array(values)))
        prefix_tables, prefix_lens = np.array([[3, 0]], dtype=np.int32), np.array([32], dtype=np.int32)
        prefix_of = np.array([0, -1], dtype=np.int32)
        own_tables, own_lens = np.array([[7, 2], [5, 9]], dtype=np.int32), np.array([8, 17], dtype=np.int32)
        _close(ops.paged_attention_cascade(mx.array(q), k, v, mx.array(prefix_tables), mx.array(prefix_lens),
                                           mx.array(prefix_of), mx.array(own_tables), mx.array(own_lens)),
               reference.paged_attention_cascade(q, kc, vc, prefix_tables, prefix_lens, prefix_of, own_tables,
                                                 own_lens))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", SMALL)
def test_cache_writes_and_copies(backend, head_dim):
    rng, h, k, v, kc, vc, tables, lens = _setup(head_dim)
    with kv.use_backend(backend):
        rows = rng.standard_normal((3, 2, head_dim)).astype(np.float32)
        slots = np.array([5, -1, 100], dtype=np.int32)
        k2, v2 = ops.reshape_and_cache(mx.array(rows), mx.array(rows), k, v, mx.array(slots))
        want_k, _ = reference.reshape_and_cache(rows, rows, kc, vc, slots)
        _close(k2, want_k, 0)
        src, dst = np.array([0, 3], dtype=np.int32), np.array([10, 11], dtype=np.int32)
        k3, _ = ops.copy_blocks(k2, v2, mx.array(src), mx.array(dst))
        _close(k3, reference.copy_blocks(np.array(k2), np.array(v2), src, dst)[0], 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_head_dim_32_quantized_k8_v4(backend):
    rng, h, k, v, kc, vc, tables, lens = _setup(32, bits=(8, 4))
    with kv.use_backend(backend):
        q = rng.standard_normal((2, h, 32)).astype(np.float32)
        _close(ops.paged_attention(mx.array(q), k, v, mx.array(tables), mx.array(lens)),
               reference.paged_attention(q, kc, vc, tables, lens))


@pytest.mark.parametrize("head_dim", (48, 72))
def test_quantized_formats_without_a_dividing_group_size_are_refused(head_dim):
    with pytest.raises(KVFormatError):
        KVFormat(k_bits=8, v_bits=4).for_head_dim(head_dim)


def test_small_head_dims_reach_no_kernel_family_the_registry_lacks():
    """The registry (kvmetal/backends/specialisations.py) picks its candidates at its
    GRID_HEAD_DIMS; the rules, mutants and sweeps run what it reaches. Every candidate traced
    again at every other head dim kvmetal serves (ops.SUPPORTED_HEAD_DIMS, where its formats
    fit) must reach only families the registry already covers: head_dim stays a size, not a
    code path, for every dim."""
    import dataclasses

    from kvmetal.backends import specialisations as sp
    from kvmetal.backends.metal import KernelBackend

    known = sp.all_family_keys()
    recorder = sp._Recorder()
    backend = KernelBackend("families", recorder, macos=15)
    traced = 0
    others = [d for d in ops.SUPPORTED_HEAD_DIMS if d not in sp.GRID_HEAD_DIMS]
    assert set(SMALL) <= set(others)
    for f in sp._candidates():
        if f.head_dim != sp.GRID_HEAD_DIMS[0] and f.op not in ("gather_kv_cache", "reshape_and_cache", "copy_blocks"):
            continue
        for head_dim in others:
            if sp._fits(head_dim, f.k_quant) and sp._fits(head_dim, f.v_quant):
                keys = sp._trace_keys(backend, recorder, dataclasses.replace(f, head_dim=head_dim))
                assert keys <= known, (f, head_dim, sorted(keys - known, key=str)[:3])
                traced += 1
    assert traced > 100 * len(others)
