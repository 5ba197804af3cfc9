"""The mlx-lm adapter: the drop-in paged cache and attention for mlx-lm models (mlx_lm.py,
model_cache.py). Continuous batching is ``kvmetal.engine``, the commands ``kvmetal.commands``."""
