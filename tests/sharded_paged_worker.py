"""One rank of tests/test_mlx_lm_sharded.py, started by ``mlx.launch``.

Builds the same small random model on every rank, shards it over the ring group by
heads (mlx-lm's ``model.shard``), generates greedily with kvmetal's paged cache and
writes this rank's tokens and KV statistics to ``OUT_DIR/rank{r}.json``.
"""
from __future__ import annotations

import json
import sys

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from kvmetal.integrations import tiny_models
from kvmetal.engine.engine import Engine
from kvmetal.integrations.mlx_lm import use_paged_cache

PROMPT = list(range(3, 40))
ENGINE_PROMPTS = [list(range(3, 40)), list(range(3, 30)) + [7, 8], list(range(50, 70))]
ENGINE_MAX_TOKENS = [24, 20, 28]


def engine_run(model) -> dict:
    """Engine on a pool small enough that decode must preempt (recompute) requests."""
    with Engine(model, block_size=16, num_blocks=7) as engine:
        outputs = engine.run(ENGINE_PROMPTS, ENGINE_MAX_TOKENS)
        return dict(outputs=outputs, preemptions=engine.preemptions)


def main(out_dir: str, family: str, steps: int) -> None:
    group = mx.distributed.init()
    model = tiny_models.build(family, seed=0)
    model.shard(group)
    with use_paged_cache(model, block_size=16):
        cache = make_prompt_cache(model)
        tokens = [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=steps,
                                                   sampler=lambda lp: mx.argmax(lp, axis=-1), prompt_cache=cache)]
        stats = cache[0].model_cache.stats(group)
        tables = [cache[0].pool.allocator.block_table(cache[0].seq_ids[0])]
    engine = engine_run(model)
    with open(f"{out_dir}/rank{group.rank()}.json", "w") as f:
        json.dump(dict(tokens=tokens, stats=stats, tables=tables, kv_heads=cache[0].pool.num_kv_heads,
                       engine=engine), f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
