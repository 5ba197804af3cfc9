"""Moved to ``kvmetal.engine.engine``; this old path is that module under its old name."""
from ..engine import engine
from ._moved import moved

moved(__name__, engine)
