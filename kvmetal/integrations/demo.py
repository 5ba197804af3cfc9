"""Moved to ``kvmetal.commands.demo``; this old path is that module under its old name."""
from ..commands import demo
from ._moved import moved

moved(__name__, demo)
