"""Pool bytes of kvmetal's paged cache after a long prefill, beside ``kvmetal budget``.

Builds the :class:`~kvmetal.integrations.model_cache.PagedModelCache` a model directory's
config implies (sliding-window layers in their own group, as ``use_paged_cache`` makes
it), then makes the allocator calls a chunked prefill makes (``append`` of ``--chunk``
tokens at a time, window groups evicting first) up to ``--context`` tokens, then
``--decode`` one-token steps. No attention is computed: the blocks and bytes are those
the model's forward passes allocate (bench/kv_quality.py records the same figures after
its real passes). Reported per format: blocks in use per group, the bytes the owned
blocks hold, the bytes the grown pool holds, and ``kvmetal budget``'s cache bytes.

    python bench/pool_bytes.py --model gemma3 --context 32768 --json bench/pool_bytes_gemma3.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

FORMATS = {"f32": (None, None, 64), "K8/V8 g64": (8, 8, 64), "K8/V4 g64": (8, 4, 64), "K8/V4 g32": (8, 4, 32),
           "K4/V4 g64": (4, 4, 64)}


def layer_specs(config: dict, dtype) -> list:
    """Per layer: window (None = global) and K/V row shape, from a gemma3_text/llama config."""
    from kvmetal.budget import shape_from_config
    from kvmetal.integrations.model_cache import LayerSpec

    shape = shape_from_config(config)
    window, pattern = config.get("sliding_window"), config.get("sliding_window_pattern")
    windows = [window if window and pattern and (i + 1) % pattern else None for i in range(shape.num_layers)]
    return [LayerSpec(w, shape.num_kv_heads, shape.head_dim, dtype) for w in windows]


def measure(specs, *, k_bits, v_bits, group, block_size: int, context: int, chunk: int, decode: int) -> dict:
    from kvmetal.integrations.model_cache import PagedModelCache

    cache = PagedModelCache(specs, block_size=block_size, k_bits=k_bits, v_bits=v_bits, group_size=group)
    seq = cache.new_seq_id()
    cache.add_sequence(seq, num_tokens=min(chunk, context))
    done = min(chunk, context)
    while done < context:
        n = min(chunk, context - done)
        cache.append(seq, num_tokens=n)
        done += n
    for _ in range(decode):
        cache.append(seq, num_tokens=1)
    return {"tokens": cache.num_tokens(seq), "used_bytes": cache.used_bytes, "pool_bytes": cache.nbytes,
            "groups": [{"window": w, "layers": cache.layer_group.count(g), "used_blocks": p.stats()["used_blocks"],
                        "pool_blocks": p.stats()["num_blocks"]}
                       for g, (w, p) in enumerate(zip(cache.windows, cache.pools))]}


def budget_bytes(config: dict, *, k_bits, v_bits, group, dtype: str, context: int, block_size: int) -> int:
    from kvmetal import cli

    import contextlib
    import io

    kv = ["--kv", dtype.replace("float", "f")] if k_bits is None else \
        ["--k-bits", str(k_bits), "--v-bits", str(v_bits), "--group-size", str(group)]
    path = Path("/tmp") / "kvmetal-pool-bytes-config.json"
    path.write_text(json.dumps(config))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["budget", "--model", str(path), "--context", str(context), "--block-size", str(block_size),
                         "--dtype", dtype, "--json"] + kv) == 0
    return int(json.loads(out.getvalue())["cache_bytes"])


def main(argv=None) -> int:
    import mlx.core as mx

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma3", help="a model directory or a named model (default gemma3)")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (bench/kv_quality.py's, default 512)")
    p.add_argument("--decode", type=int, default=0, help="one-token steps after the prefill")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="float32", help="the model's K/V dtype (float32 for the float32 weights)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from kvmetal.models.named import MODELS, named_model_path

    path = named_model_path(args.model, "float32") if args.model in MODELS else Path(args.model)
    config = json.loads((path / "config.json").read_text())
    specs = layer_specs(config, getattr(mx, args.dtype))
    report = {"model": path.name, "context": args.context, "chunk": args.chunk, "decode": args.decode,
              "block_size": args.block_size, "dtype": args.dtype, "formats": {}}
    print(f"{path.name}: {args.context} tokens in chunks of {args.chunk}, then {args.decode} decode steps; "
          f"block {args.block_size}")
    print("| format | budget | used (owned blocks) | pool held | window group blocks | full group blocks |")
    print("|---|---|---|---|---|---|")
    for name, (k, v, g) in FORMATS.items():
        r = measure(specs, k_bits=k, v_bits=v, group=g, block_size=args.block_size, context=args.context,
                    chunk=args.chunk, decode=args.decode)
        r["budget_bytes"] = budget_bytes(config, k_bits=k, v_bits=v, group=g, dtype=args.dtype,
                                         context=args.context, block_size=args.block_size)
        report["formats"][name] = r
        blocks = {("window" if grp["window"] else "full"): grp["used_blocks"] for grp in r["groups"]}
        print(f"| {name} | {r['budget_bytes'] / 2**20:.1f} MiB | {r['used_bytes'] / 2**20:.1f} MiB | "
              f"{r['pool_bytes'] / 2**20:.1f} MiB | {blocks.get('window')} | {blocks.get('full')} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
