"""Moved to ``kvmetal.engine.scheduler``; this old path is that module under its old name."""
from ..engine import scheduler
from ._moved import moved

moved(__name__, scheduler)
