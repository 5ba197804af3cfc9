"""A sweep of bad values through every argument of every public op, on every backend here.

Each call must either run (and evaluate) or raise ValueError, TypeError or
NotImplementedError whose message names the op and the argument that was changed;
any other exception (IndexError, ZeroDivisionError, RuntimeError from a kernel, ...)
or an unnamed argument fails. With ``validate=False`` out-of-range indices must run:
the kernels guard them (test_index_guards.py checks what they then compute). Each
(backend, op) sweep runs in its own process, so a crash fails that test, not pytest.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import kvmetal as kv
from kvmetal import quant
from kvcases import backend_params, paged_case

BACKENDS = backend_params()  # metal skipped, with the reason, off a Mac
OPTIONS = {"paged_attention": ["scale", "softcap", "sliding_window", "sinks", "num_splits", "validate"],
           "decode_attention": ["scale", "softcap", "sinks", "num_splits"],
           "gather_kv_cache": ["max_len", "validate"], "reshape_and_cache": ["validate"], "copy_blocks": ["validate"]}


def _good_calls():
    c = paged_case([5, 30], dtype=mx.float16)
    rows = mx.zeros((2, 2, 64))
    return {
        "reshape_and_cache": (kv.reshape_and_cache, dict(key=rows, value=rows, key_cache=c.key_cache,
                                                         value_cache=c.value_cache, slot_mapping=mx.array([90, 91]))),
        "paged_attention": (kv.paged_attention, dict(query=c.query, key_cache=c.key_cache, value_cache=c.value_cache,
                                                     block_tables=c.block_tables, seq_lens=c.seq_lens)),
        "gather_kv_cache": (kv.gather_kv_cache, dict(key_cache=c.key_cache, value_cache=c.value_cache,
                                                     block_tables=c.block_tables, seq_lens=c.seq_lens)),
        "decode_attention": (kv.decode_attention, dict(query=mx.zeros((2, 8, 1, 64)), keys=mx.zeros((2, 2, 8, 64)),
                                                       values=mx.zeros((2, 2, 8, 64)))),
        "copy_blocks": (kv.copy_blocks, dict(key_cache=c.key_cache, value_cache=c.value_cache, src=mx.array([0]),
                                             dst=mx.array([5]))),
    }


def _bad_values(good):
    """Wrong types, wrong dtypes, wrong ranks, empty and far-out-of-range versions of ``good``."""
    values = [None, 3, 2.5, "x", True, [1, 2], np.zeros(3), float("nan"), -1, 2**63, mx.array(1.0),
              mx.zeros((0,)), mx.zeros((2, 2, 2, 2, 2)),
              quant.QuantizedKV(mx.zeros((2,)), mx.zeros((2,)), mx.zeros((2,)), 8, 64)]
    if isinstance(good, mx.array):
        values += [good.astype(dt) for dt in (mx.int32, mx.int64, mx.float32, mx.bool_, mx.uint8, mx.complex64)]
        if good.ndim:
            values += [good[..., :0], good[:0], good[None], good.reshape(-1)]
        if good.dtype in (mx.int32, mx.int64):
            values += [good * 0 - 5, good + 10**6, good.astype(mx.int64) + 2**40, good.astype(mx.int64) - 2**40]
        else:
            values.append(good * float("nan"))
    return values


def sweep(backend: str, op: str) -> list:
    """Problems found calling ``op`` on ``backend`` with every bad value of every argument."""
    fn, args = _good_calls()[op]
    problems = []
    with kv.use_backend(backend):
        for name in [*args, *OPTIONS[op]]:
            for value in _bad_values(args.get(name, mx.zeros((8,)))):
                for validate in ((True, False) if "validate" in OPTIONS[op] and name != "validate" else (None,)):
                    kwargs = {**args, name: value, **({} if validate is None else {"validate": validate})}
                    try:
                        mx.eval(fn(**kwargs))
                    except (ValueError, TypeError, NotImplementedError) as exc:
                        if f"[{op}]" not in str(exc) or name not in str(exc):
                            problems.append(f"{name}={value!r:.60} validate={validate}: {exc}")
                    except Exception as exc:  # noqa: BLE001 - any other class is the finding
                        problems.append(f"{name}={value!r:.60} validate={validate}: {type(exc).__name__}: {exc}")
    return problems


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", sorted(OPTIONS))
def test_every_bad_value_runs_or_raises_an_error_naming_the_argument(backend, op):
    here = Path(__file__).resolve().parent
    code = (f"import sys; sys.path.insert(0, {str(here)!r})\n"
            "import test_bad_input_sweep as t\n"
            f"problems = t.sweep({backend!r}, {op!r})\n"
            "print('\\n'.join(problems[:20])); print('problems:', len(problems))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=here)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("problems: 0"), (
        f"exit code {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-3000:]}")
