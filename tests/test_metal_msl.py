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


@needs_clang
def test_clang_pass_catches_a_device_pointer_used_as_threadgroup(generated):
    name, source = next((n, s) for n, s in generated.items() if "paged_attention_partials" in n)
    wrong = source.replace("merge_stats, merge_acc, tile_k,", "merge_stats, merge_acc, part_acc,", 1)
    assert wrong != source
    findings = msl_check.syntax({name: wrong})
    assert findings and "kv_attend" in findings[0]
