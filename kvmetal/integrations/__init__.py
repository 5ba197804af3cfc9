"""The mlx-lm adapter: the drop-in paged cache and attention for mlx-lm models (mlx_lm.py,
model_cache.py), and the `kvmetal demo` / `kvmetal generate` commands. Continuous batching
is ``kvmetal.engine``."""
