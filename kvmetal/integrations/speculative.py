"""Moved: drafting to ``kvmetal.engine.proposers``, the acceptance rule (``verify``) to
``kvmetal.engine.sampler``; this old path reads and sets names in both."""
from ..engine import proposers, sampler
from ._moved import moved

moved(__name__, proposers, sampler)
