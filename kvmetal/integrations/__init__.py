"""The mlx-lm adapter: the drop-in paged cache and attention for mlx-lm models (mlx_lm.py,
model_cache.py). Continuous batching is ``kvmetal.engine``, the commands ``kvmetal.commands``;
their old paths here (``kvmetal.integrations.engine`` ...) still import (_moved.py)."""
from ._moved import install as _install_old_paths

_install_old_paths(__name__)
