"""Planners: blueprints without an oracle.

``SymbolPlanner`` (``symbols.py``) reads the session's messages and the agent's planned steps and
emits a blueprint from literal identifiers (``extract.py``: ``ast``/``tokenize`` for code, a word
model for prose); it also restores evicted definitions that a new user turn names (rehydration).
Plug it into ``PACESession(..., planner=SymbolPlanner(steps), rehydrate=True)``.
"""

from .extract import Symbols, read
from .symbols import SymbolPlanner

__all__ = ["SymbolPlanner", "Symbols", "read"]
