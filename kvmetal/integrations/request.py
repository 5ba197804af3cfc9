"""Moved to ``kvmetal.engine.request``; this old path is that module under its old name."""
from ..engine import request
from ._moved import moved

moved(__name__, request)
