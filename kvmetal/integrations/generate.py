"""Moved to ``kvmetal.commands.generate``; this old path is that module under its old name."""
from ..commands import generate
from ._moved import moved

moved(__name__, generate)
