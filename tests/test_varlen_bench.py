"""`kvmetal bench --cases prefill_chunked`: chunked prefill, kvmetal varlen next to gather + SDPA."""
from __future__ import annotations

import contextlib
import io
import json

from kvmetal import cli


def test_prefill_case_reports_time_peak_memory_and_the_baseline():
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["bench", "--json", "--backend", "cpu", "--tokens", "700", "--repeat", "1",
                         "--cases", "prefill_chunked"])
    assert code == 0, err.getvalue()
    (row,) = json.loads(out.getvalue())["results"]
    assert row["name"] == "prefill_varlen_f16 T=700 chunk=512"
    assert row["seconds"] > 0 and row["peak_bytes"] > 0
    assert row["baseline"]["name"].startswith("gather_kv_cache + mx.fast.scaled_dot_product_attention")
    assert row["baseline"]["peak_bytes"] > 0 and row["speedup_vs_baseline"] > 0
