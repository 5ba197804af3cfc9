"""Issue 30: the rules of issue 17 held by every kernel family, derived from the one
registry (``kvmetal.backends.metal_specs.SPECS``, reached through
``specialisations.specialisation_families``), never from a list in this file. A kernel
added to SPECS gets every rule here without anyone editing a test: it must name its
code-selecting parameters and be reached by a family (the first test), and then each
rule below runs it.

Rules, each on the simulator (strict, both schedule seeds) against the float64 oracle:
softcap with scores far past fast tanh's overflow on macOS 15 (relaxed math) and 14;
inputs under 8 elements bound as `constant`; splits with no work; K/V as strided views
for kernels that read strides; and no launch past the pipeline limits of an M1.
"""
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from kvmetal import chips, ops
from kvmetal import reference as ref
from kvmetal.backends import metal, metal_layout, metal_specs, specialisations
from kvmetal.sim.backend import sim_backend

from kvcases import assert_close, run_on, SEEDS

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import kernel_limits  # noqa: E402

SCORE_KERNELS = sorted(name for name, spec in metal_specs.SPECS.items() if "query" in spec.inputs)
STRIDED_KERNELS = sorted(name for name, spec in metal_specs.SPECS.items() if not spec.row_contiguous)


def _cost(f: specialisations.Family) -> int:
    rows = f.num_seqs * f.query_len * f.gqa * f.num_kv_heads
    return rows * f.tokens * f.head_dim * (2 if f.dtype == "float32" else 1)


def cheapest(kernel: str, where=lambda f, keys: True) -> specialisations.Family:
    """The cheapest family of the registry that launches ``kernel`` (and satisfies ``where``)."""
    found = [f for f in specialisations.specialisation_families()
             if f.op in specialisations.ATTENTION_OPS and any(k[0] == kernel for k in f.keys) and where(f, f.keys)]
    assert found, f"no family of the registry launches {kernel} with the property asked for"
    return min(found, key=_cost)


def run_family(f, *, seed=0, scale_query=1.0, **options):
    """Run family ``f`` on the simulator under every schedule seed against the oracle;
    returns the names of the kernels launched."""
    args, kwargs = specialisations.family_inputs(f, seed=seed)
    fn = getattr(ops, f.op)
    query = args[0] * scale_query
    args = (query, *args[1:])
    kwargs = {**kwargs, **options}
    expected = getattr(ref, fn.__name__)(*args, **kwargs)
    launched = set()
    for schedule in SEEDS:
        with run_on("sim", seed=schedule) as trace:
            out = fn(*args, **kwargs)
            mx.eval(out)
        assert out.shape == query.shape and out.dtype == query.dtype
        assert_close(out, expected, query.dtype)
        launched |= {c.name for c in trace.calls}
    return launched


def _launched(names, kernel) -> bool:
    return any(kernel in n for n in names)


# ----------------------------------------------------------------------------- the registry

def test_registry_reaches_every_kernel():
    assert set(specialisations.PATH_PARAMETERS) == set(metal_specs.SPECS)
    reached = {key[0] for key in specialisations.all_family_keys()}
    assert reached == set(metal_specs.SPECS)
    # The families the rules below run: decode, paged, varlen and cascade all score.
    assert {"paged_attention_partials", "decode_attention_partials", "paged_varlen_partials",
            "cascade_partials"} <= set(SCORE_KERNELS)


def test_every_kernel_file_has_specs():
    kernels = Path(__file__).resolve().parent.parent / "kernels"
    assert {p.stem for p in kernels.glob("*.metal")} == {spec.family for spec in metal_specs.SPECS.values()}


# ----------------------------------------------------------------------------- fast-math softcap

@pytest.mark.parametrize("macos", [15, 14])
@pytest.mark.parametrize("kernel", SCORE_KERNELS)
def test_softcap_with_scores_far_past_fast_tanh_overflow(kernel, macos, monkeypatch):
    # Queries x 300 with softcap 5: tanh's argument reaches hundreds; Metal's fast tanh
    # (relaxed math, macOS 15+) is NaN past ~44 and would drop the highest-scoring keys.
    monkeypatch.setattr(metal_specs, "default_macos_version", lambda: macos)
    f = cheapest(kernel)
    launched = run_family(f, scale_query=300.0, softcap=5.0)
    assert _launched(launched, kernel)
    assert metal_specs.math_mode_for(metal_specs.SPECS[kernel].math_mode, macos) == ("relaxed" if macos >= 15 else "safe")


# ----------------------------------------------------------------------------- `constant` inputs

def _constant_kernels():
    keys = set().union(*(f.keys for f in specialisations.specialisation_families()))
    return sorted({k[0] for k in keys if k[1] == "constant"})


def test_no_kernel_is_reached_with_constant_inputs():
    # Issue 41, R1: the backend grows every input under 8 elements (metal._device_bound),
    # so no configuration of the registry binds one `constant` (before: every attention
    # kernel, the reduces included, had such configurations: batch 1-7 ran other
    # pipelines than batch 8+). tests/test_metal_device_binding.py runs batches 1-9.
    assert _constant_kernels() == []


# ----------------------------------------------------------------------------- empty splits

@pytest.mark.parametrize("policy", metal_layout.SPLIT_POLICIES)
@pytest.mark.parametrize("kernel", SCORE_KERNELS)
def test_more_splits_than_work(kernel, policy, monkeypatch):
    # Every launch asks for more splits than its work fills (MAX_SPLITS, or 6 windows
    # more than a sequence spans): splits past the work see no token (and must neither
    # read past a table nor write a partial the reduce takes as real).
    monkeypatch.setenv("KVMETAL_METAL_SPLITS", policy)
    monkeypatch.setattr(metal, "choose_num_splits", lambda *a, **k: metal_layout.MAX_SPLITS)
    windows = metal_layout.window_splits
    monkeypatch.setattr(metal, "window_splits", lambda *a, **k: windows(*a, **k) + 6)
    f = cheapest(kernel)
    assert _launched(run_family(f, seed=1), kernel)


# ----------------------------------------------------------------------------- strided views

@pytest.mark.parametrize("kernel", STRIDED_KERNELS)
def test_strided_kernels_read_views_with_8_byte_aligned_rows(kernel):
    # K and V are views into rows 8 bytes wider (8-byte aligned, not 16): a kernel that
    # reads strides must not assume 16-byte rows.
    f = cheapest(kernel, lambda f, keys: not f.k_quant and not f.v_quant)
    (query, k, v), kwargs = specialisations.family_inputs(f)
    fn = getattr(ops, f.op)
    pad = 8 // k.dtype.size
    wide = lambda x: mx.concatenate([x, mx.zeros((*x.shape[:-1], pad), x.dtype)], axis=-1)[..., :x.shape[-1]]
    kw, vw = wide(k), wide(v)
    expected = getattr(ref, fn.__name__)(query, k, v, **kwargs)
    for schedule in SEEDS:
        with run_on("sim", seed=schedule) as trace:
            out = fn(query, kw, vw, **kwargs)
            mx.eval(out)
        assert_close(out, expected, query.dtype)
        assert any(kernel in c.name for c in trace.calls)


# ----------------------------------------------------------------------------- thread and register limits

def test_every_launch_within_the_pipeline_limits():
    rows = kernel_limits.launches()
    assert {r[1] for r in rows} == set(metal_specs.SPECS)
    over = [r for r in rows if r[3] > min(chips.PIPELINE_THREAD_LIMIT, chips.max_threads_for_registers(r[4]))]
    assert over == []


DECODE_FAMILY = ("paged_attention_partials", "decode_attention_partials", "cascade_partials")


def test_every_decode_family_launch_within_the_registers_a_thread_has():
    # Issue 41, P1: the partials kernels (kv_attend) keep every lane's estimated live
    # registers within the 128 an Apple GPU thread has (no per-pass state spilled), in
    # every mode, over every launch of the registry.
    rows = [r for r in kernel_limits.launches() if r[1] in DECODE_FAMILY]
    assert {r[1] for r in rows} == set(DECODE_FAMILY)
    assert {mode for _, kernel, mode, _, _ in rows if kernel == "paged_attention_partials"} == {
        "register", "shared", "shared-multipass"}
    over = [r for r in rows if r[4] > chips.PIPELINE_REGISTER_LIMIT]
    assert chips.PIPELINE_REGISTER_LIMIT == 128 and over == []


def test_every_varlen_launch_within_the_register_budget():
    """Issue 41, P1: every paged_varlen_partials launch of the registry estimates at most
    chips.PIPELINE_REGISTER_LIMIT (128) registers a lane (D 256 splits D), and so does the default
    tile of every head_dim the ops serve at every tile element size."""
    rows = [r for r in kernel_limits.launches() if r[1] == "paged_varlen_partials"]
    assert any("-d256-" in r[0] for r in rows)
    assert [r for r in rows if r[4] > chips.PIPELINE_REGISTER_LIMIT] == []
    for d in ops.SUPPORTED_HEAD_DIMS:
        for k_item, v_item, q_item in ((2, 2, 2), (4, 2, 2), (4, 4, 4)):
            t = metal_layout.varlen_tiles(head_dim=d, k_itemsize=k_item, v_itemsize=v_item, q_itemsize=q_item)
            regs = metal_layout.varlen_registers(head_dim=d, block_k=t.block_k, row_fragments=t.row_fragments,
                                                 d_split=t.d_split)
            assert regs <= chips.PIPELINE_REGISTER_LIMIT, (d, k_item, v_item, q_item, t, regs)


def test_sim_backend_refuses_a_launch_over_the_thread_limit():
    from kvmetal.sim.errors import ThreadgroupSizeError

    backend = sim_backend()
    tiles = metal_layout.VarlenTiles(simdgroups=metal_layout.MAX_SHARED_SIMDGROUPS + 1, block_k=8)  # 416 threads
    rng = np.random.default_rng(0)
    q = mx.array(rng.standard_normal((12, 1, 64)).astype(np.float32))
    kc = mx.array(rng.standard_normal((2, 1, 8, 64)).astype(np.float32))
    with pytest.raises(ThreadgroupSizeError, match=r"Thread group size \(416\) is greater than the maximum allowed"):
        backend.paged_attention_varlen(q, kc, kc, mx.array([[0, 1]], mx.int32), mx.array([12], mx.int32),
                                       mx.array([0, 12], mx.int32), scale=0.125, softcap=None, sliding_window=None,
                                       sinks=None, tiles=tiles)
    with pytest.raises(ValueError, match="simdgroups"):
        metal_layout.varlen_tiles(head_dim=64, k_itemsize=4, v_itemsize=4, simdgroups=metal_layout.MAX_SHARED_SIMDGROUPS + 1)


def test_every_kernel_mutant_still_finds_its_snippet():
    # tools/mutate_kernels.py's mutants name a snippet of today's kernels; a kernel change that
    # removes one leaves that mutant "not applicable" and its check silently gone (stop 48
    # found 14 such, from P2, P1 and varlen's RF rewrite). Each snippet is in its file once.
    import mutate_kernels

    kernels = Path(__file__).resolve().parents[1] / "kernels"
    counts = {m.name: (kernels / m.file).read_text().count(m.old) for m in mutate_kernels.MUTANTS}
    assert {name: n for name, n in counts.items() if n != 1} == {}
