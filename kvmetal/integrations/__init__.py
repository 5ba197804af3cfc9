"""Model integrations: the mlx-lm drop-in (mlx_lm.py), continuous batching (engine.py),
and the `kvmetal demo` / `kvmetal generate` commands."""
