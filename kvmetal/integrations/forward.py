"""Moved to ``kvmetal.engine.runner``; this old path is that module under its old name."""
from ..engine import runner
from ._moved import moved

moved(__name__, runner)
