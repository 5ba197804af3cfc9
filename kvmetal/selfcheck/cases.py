"""The cases Correct runs: a fixed shape matrix per op, and a randomized sweep.

Each case is a dict of plain values (op, dtype tag, head_dim ``d``, block size ``bs``,
kv heads ``hkv``, GQA ``g``, query rows ``L``, lengths, K/V formats as (bits, group
size), options), so that :func:`describe` turns it into a one-line reproducer.
"""
from __future__ import annotations

import numpy as np

from .families import DTYPES, specialisation_families


def describe(c: dict) -> str:
    """A one-line description of a case, enough to reproduce it."""
    skip = {"op"}
    return " ".join(f"{k}={v}" for k, v in c.items() if k not in skip and v is not None)


# ----------------------------------------------------------------------------- the shape matrix

K8V4 = dict(k=(8, 64), v=(4, 64))


def _f(**kw):
    return kw


def matrix(quick: bool) -> list:
    """The fixed cases: paged decode at L = 1..8 (each family's point where it has one,
    so the quick run reuses the kernels Compile built), contiguous decode, writes,
    gathers, copies, and the optional ops."""
    paged = [
        _f(op="paged_attention", dtype="f16", d=128, bs=16, hkv=2, g=4, L=1, lens=(1, 37, 200)),
        _f(op="paged_attention", dtype="bf16", d=96, bs=32, hkv=2, g=4, L=2, lens=(2, 70), k=(3, 32), v=(6, 32),
           window=16),
        _f(op="paged_attention", dtype="bf16", d=80, bs=8, hkv=2, g=4, L=3, lens=(3, 45), softcap=30.0),
        _f(op="paged_attention", dtype="f16", d=128, bs=16, hkv=2, g=4, L=4, lens=(4, 129), sinks=True, **K8V4),
        _f(op="paged_attention", dtype="f16", d=64, bs=8, hkv=2, g=4, L=5, lens=(5, 33), k=(5, 32), splits=3),
        _f(op="paged_attention", dtype="f16", d=128, bs=16, hkv=2, g=4, L=6, lens=(6, 50)),
        _f(op="paged_attention", dtype="f16", d=128, bs=16, hkv=2, g=4, L=7, lens=(40, 7), sinks=True),
        _f(op="paged_attention", dtype="f32", d=256, bs=32, hkv=2, g=4, L=8, lens=(8, 100)),
        _f(op="paged_attention", dtype="f16", d=128, bs=16, hkv=2, g=4, L=1, lens=(300, 17), window=64,
           softcap=30.0, sinks=True, splits=5, **K8V4),
    ]
    others = [
        _f(op="decode_attention", dtype="f16", d=128, hkv=2, g=4, L=1, b=2, T=77),
        _f(op="decode_attention", dtype="f16", d=128, hkv=2, g=4, L=4, b=1, T=150, sinks=True, **K8V4),
        _f(op="decode_attention", dtype="bf16", d=80, hkv=2, g=4, L=3, b=2, T=33, softcap=30.0),
        _f(op="reshape_and_cache", dtype="f16", d=128, bs=16, hkv=2),
        _f(op="reshape_and_cache", dtype="f16", d=128, bs=16, hkv=2, **K8V4),
        _f(op="reshape_and_cache", dtype="bf16", d=96, bs=32, hkv=2, k=(3, 32), v=(6, 32)),
        _f(op="gather_kv_cache", dtype="f16", d=128, bs=16, hkv=2, lens=(1, 37)),
        _f(op="gather_kv_cache", dtype="f16", d=128, bs=16, hkv=2, lens=(20, 5), **K8V4),
        _f(op="gather_kv_cache", dtype="bf16", d=96, bs=32, hkv=2, lens=(40,), k=(3, 32), v=(6, 32)),
        _f(op="copy_blocks", dtype="bf16", d=80, bs=8, hkv=2),
        _f(op="copy_blocks", dtype="f16", d=128, bs=16, hkv=2, **K8V4),
        _f(op="paged_attention_varlen", dtype="f16", d=128, bs=16, hkv=2, g=4, lens=(1, 40, 90), runs=(1, 5, 12)),
        _f(op="paged_attention_varlen", dtype="f16", d=128, bs=16, hkv=2, g=4, lens=(33, 7), runs=(33, 1),
           window=16, sinks=True, **K8V4),
        _f(op="paged_attention_cascade", dtype="f16", d=128, bs=16, hkv=2, g=4, prefix_lens=(64, 32),
           prefix_of=(0, 0, 1, -1), lens=(5, 20, 1, 30)),
        _f(op="paged_attention_cascade", dtype="f16", d=128, bs=16, hkv=2, g=4, prefix_lens=(48,),
           prefix_of=(0, 0, 0, -1, 0), lens=(3, 0, 17, 9, 1), softcap=30.0, sinks=True, **K8V4),
    ]
    if not quick:  # more GQA factors and block sizes than the families reach
        paged += [
            _f(op="paged_attention", dtype="f16", d=128, bs=16, hkv=4, g=1, L=1, lens=(1, 255)),
            _f(op="paged_attention", dtype="f32", d=64, bs=8, hkv=1, g=8, L=2, lens=(90,), sinks=True),
            _f(op="paged_attention", dtype="bf16", d=128, bs=16, hkv=2, g=6, L=1, lens=(33, 160), softcap=50.0),
            _f(op="paged_attention", dtype="f16", d=256, bs=32, hkv=1, g=16, L=4, lens=(500,), **K8V4),
            # head_dim 512 (gemma4's global layers, issue 40): register and shared mode, varlen DS 4 + SKV
            _f(op="paged_attention", dtype="f16", d=512, bs=16, hkv=2, g=8, L=1, lens=(1, 300), sinks=True, **K8V4),
            _f(op="paged_attention", dtype="f32", d=512, bs=16, hkv=1, g=1, L=1, lens=(77,)),
            _f(op="paged_attention_varlen", dtype="f16", d=512, bs=16, hkv=2, g=4, lens=(40, 90), runs=(20, 45),
               **K8V4),
        ]
    return paged + others


def sweep(count: int, seed: int, quick: bool) -> list:
    """Random paged and contiguous decode cases: lengths, options and split counts drawn
    at random. Quick: at the families' points (no new kernels to build); full: anywhere
    in a wider space (GQA 1-8, D 64-512, every block size and format)."""
    rng = np.random.default_rng(seed)
    families = specialisation_families()
    cases = []
    for i in range(count):
        if quick:
            point = families[rng.integers(len(families))].point()
        else:
            d = int(rng.choice([64, 80, 96, 128, 256, 512]))
            fmts = [None, (8, 64), (4, 64), (4, 32), (3, 32), (5, 32), (6, 32), (2, 32)]
            pick = lambda: fmts[rng.integers(len(fmts))]
            k, v = pick(), pick()
            ok = lambda fmt: fmt is None or (d % fmt[1] == 0 and d * fmt[0] % 32 == 0)
            point = dict(dtype=str(rng.choice(list(DTYPES))), d=d, bs=int(rng.choice([8, 16, 32])),
                         hkv=int(rng.choice([1, 2, 4])), g=int(rng.choice([1, 2, 4, 6, 8])),
                         L=int(rng.integers(1, 9)), k=k if ok(k) else None, v=v if ok(v) else None)
        opts = dict(softcap=float(rng.choice([20.0, 50.0])) if rng.random() < 0.3 else None,
                    sinks=True if rng.random() < 0.3 else None,
                    splits=int(rng.integers(1, 8)) if rng.random() < 0.5 else None)
        if i % 3 == 2:  # every third: contiguous decode
            cases.append(dict(op="decode_attention", **point, b=int(rng.integers(1, 3)),
                              T=int(rng.integers(point["L"], 160)), **opts, sweep=i))
        else:
            lens = tuple(int(n) for n in rng.integers(point["L"], 220, size=int(rng.integers(1, 4))))
            window = int(rng.integers(1, 80)) if rng.random() < 0.3 else None
            cases.append(dict(op="paged_attention", **point, lens=lens, window=window, **opts, sweep=i))
    return cases
