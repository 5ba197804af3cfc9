"""``kvmetal convert-gguf FILE.gguf OUT_DIR``: a llama or gemma3 GGUF file as an mlx-lm model directory.

    kvmetal convert-gguf SmolLM2-135M-Instruct.Q4_1.gguf ./smollm2 --dtype float32
    kvmetal convert-gguf gemma-3-270m-q4_k_m.gguf ./gemma3 --dtype float32

``--dtype keep`` (default) keeps quantized tensors quantized: a llama file's Q4_0/Q4_1/Q8_0
as MLX affine group-32 exactly; a gemma3 file's K-quants (dequantized by llama.cpp's
``gguf`` package) re-quantized to MLX affine group 32 at their GGUF bits (lossy, see
kvmetal/models/gemma3_convert.py). A float dtype dequantizes everything to it.
"""
from __future__ import annotations

import argparse
import sys
import time

PROG = "kvmetal convert-gguf"


def _parser() -> argparse.ArgumentParser:
    from ..cli_args import ArgumentParser
    from .gguf import DTYPES

    p = ArgumentParser(prog=PROG, description="Convert a llama or gemma3 GGUF file to an mlx-lm model directory "
                                              "(config.json, model.safetensors, tokenizer files).")
    p.add_argument("gguf", metavar="FILE.gguf", help="the GGUF file")
    p.add_argument("out_dir", metavar="OUT_DIR", help="the model directory to write (must not exist)")
    p.add_argument("--dtype", choices=DTYPES, default="keep",
                   help="keep: quantized tensors stay quantized (default; gemma3 K-quants are re-quantized to MLX "
                        "affine group 32 at their GGUF bits); float32/float16/bfloat16: dequantize")
    p.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    return p


def main(argv=None) -> int:
    from .gguf import GGUFError, convert_gguf

    from pathlib import Path

    args = _parser().parse_args(argv)
    tic = time.perf_counter()
    if Path(args.out_dir).exists() and not args.force:
        print(f"{PROG}: error: {args.out_dir!r} already exists; --force replaces it", file=sys.stderr)
        return 2
    try:
        out = convert_gguf(args.gguf, args.out_dir, dtype=args.dtype, overwrite=args.force)
    except GGUFError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out} ({size / 1e6:.1f} MB, dtype {args.dtype}) in {time.perf_counter() - tic:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
