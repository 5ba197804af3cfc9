"""The MSL check (tools/msl_check.py) as a test: lint rules always, the clang
address-space pass whenever clang is installed (CI installs it: apt `clang`)."""
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import msl_check  # noqa: E402


def test_kernels_follow_msl_rules():
    assert msl_check.lint() == []


def test_lint_catches_what_metal_rejects(tmp_path):
    bad = tmp_path / "bad.metal"
    bad.write_text("inline float f(float x) { double y = x; return f(y); }\n"
                   "inline void g() { float* p = new float[4]; std::sort(p, p); }\n")
    findings = "\n".join(msl_check.lint([bad]))
    for what in ("double", "std::", "dynamic allocation", "calls itself"):
        assert what in findings


def test_lint_catches_bare_transcendentals_outside_their_owner(tmp_path):
    # The issue-30 defect: varlen.metal's softcap with a bare tanh (NaN under fast math
    # past |x| ~ 44). Any kernel file, present or future, is held to the rule.
    scratch = tmp_path / "scratch.metal"
    scratch.write_text("inline float kv_exp2(float x) { return exp2(x); }\n"   # the owner: allowed
                       "inline float cap(float s, float c) { return c * tanh(s / c); }\n"
                       "inline float w(float s, float m) { return exp2(s - m) + kv_exp2(s) + var.logit(s); }\n"
                       "inline float n(float x) { return metal::fast::exp(x) + rsqrt(x) + log(x); }\n")
    findings = msl_check.lint([scratch])
    assert [f.split(": ")[1].split(" (")[0] for f in findings] == [
        "bare tanh", "bare exp2", "bare exp", "bare rsqrt", "bare log"]
    assert all(f.startswith(f"{scratch}:") for f in findings)
    assert ":1:" not in "".join(findings)  # kv_exp2's own exp2 is the one allowed call


def test_every_kernel_file_is_linted():
    # lint() takes every kernels/*.metal and *.h: a new kernel file is checked without a list.
    kernels = Path(msl_check.__file__).resolve().parent.parent / "kernels"
    from kvmetal.backends import metal_specs

    families = {spec.family for spec in metal_specs.SPECS.values()}
    assert {p.stem for p in kernels.glob("*.metal")} == families


needs_clang = pytest.mark.skipif(shutil.which("clang") is None, reason="clang not installed (apt: clang)")


@pytest.fixture(scope="module")
def generated():
    return msl_check.generated_sources()


@needs_clang
def test_generated_sources_pass_clang_with_address_spaces(generated):
    names = {name.split("#")[0] for name in generated}
    # Every kernel family and the quantized specialisations were traced.
    for kernel in ("paged_attention_partials", "decode_attention_partials", "attention_reduce",
                   "cache_rows_convert", "cache_rows_quantize", "gather_kv_rows", "copy_blocks_gather",
                   "paged_varlen_partials"):
        assert any(kernel in n for n in names), kernel
    assert any("kbits3" in n for n in names) and any("kbits8" in n for n in names)
    assert msl_check.syntax(generated) == []


def test_every_specialisation_family_is_traced(generated):
    from kvmetal.backends import specialisations

    families = specialisations.specialisation_families()
    keys = specialisations.all_family_keys()
    # Each family adds a key no earlier one reached (the greedy cover), and the
    # kernel-selecting axes the old fixed list missed are all reached.
    assert len(families) >= 20 and all(f.keys for f in families)
    for key in [("paged_attention_partials", "mode", "shared-multipass"),
                ("decode_attention_partials", "mode", "shared-multipass"),
                ("paged_attention_partials", "LPK", 32), ("gather_kv_rows", "GS", 128)]:
        assert key in keys, key
    # Issue 41, R1: the backend grows inputs under 8 elements, so no family binds one
    # `constant` (before, decode's key_data/key_scales, block_tables and sinks were).
    assert not [k for k in keys if "constant" in k[1:]], [k for k in keys if "constant" in k[1:]][:5]
    for bits in (2, 3, 4, 5, 6, 8):
        for mode in ("register", "shared", "shared-multipass"):
            assert ("paged_attention_partials", mode, "KBITS", bits) in keys, (mode, bits)
    # and no source the clang pass compiles binds a data buffer `constant`.
    decode = [s for n, s in generated.items() if "decode_attention_partials" in n]
    assert decode and not any("const constant uint32_t* key_data" in s for s in decode)
    assert not any(f"const constant {t}* key_scales" in s for s in decode
                   for t in ("float16_t", "bfloat16_t", "float"))


@needs_clang
def test_clang_pass_catches_a_constant_pointer_cast_to_device(generated):
    # Since issue 41 (R1) the backend binds no input `constant`; the source MLX would write
    # for a tiny quantized K (key_data bound `constant`) is made from a traced one, so the
    # helpers' `constant` overloads still compile here, and the defect below is caught.
    name, traced = next((n, s) for n, s in generated.items()
                        if "decode_attention_partials" in n and "const device uint32_t* key_data" in s)
    source = traced.replace("const device uint32_t* key_data", "const constant uint32_t* key_data", 1)
    assert msl_check.syntax({name: source}) == []
    # The issue-17 defect: a `constant` input handed on as a `device` pointer.
    wrong = source.replace("kv_cache_arrays(key_data, key_scales, key_biases,",
                           "kv_cache_arrays(reinterpret_cast<const device uint32_t*>(key_data), key_scales, key_biases,",
                           1)
    assert wrong != source
    findings = msl_check.syntax({name: wrong})
    assert findings and "address_space(2)" in findings[0] and "is not allowed" in findings[0]


@needs_clang
def test_clang_pass_catches_a_device_pointer_used_as_threadgroup(generated):
    name, source = next((n, s) for n, s in generated.items() if "paged_attention_partials" in n)
    # (the scratch of KV_ATTN_THREADGROUP_ARRAYS takes a device pointer where a threadgroup one belongs)
    wrong = source.replace("merge_stats, merge_acc, tile_k,", "merge_stats, merge_acc, part_acc,", 1)
    assert wrong != source
    assert msl_check.syntax({name: source}) == []
    findings = msl_check.syntax({name: wrong})
    assert findings and "error generated" in findings[0]
