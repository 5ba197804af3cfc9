"""Moved to ``kvmetal.engine.proposers``; this old path is that module under its old name."""
from ..engine import proposers
from ._moved import moved

moved(__name__, proposers)
