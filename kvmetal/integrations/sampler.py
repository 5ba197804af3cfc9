"""Moved to ``kvmetal.engine.sampler``; this old path is that module under its old name."""
from ..engine import sampler
from ._moved import moved

moved(__name__, sampler)
