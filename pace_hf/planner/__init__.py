"""Planners: blueprints without an oracle.

``SymbolPlanner`` (``symbols.py``) reads the session's messages (``extract.py``: ``ast`` over tool
output as agents print it) and the agent's planned steps (literal identifiers, dotted names, and
prose through ``prose.py``, bare words included), and plans the token span of each definition a step
needs (of one too large for the step, class or function, its digest: ``digest.py``); it also restores
evicted definitions that a new user turn names (rehydration). Plug it into ``PACESession(..., planner=SymbolPlanner(steps), rehydrate=True)``.
"""

from .extract import Definition, Reading, mentions, read
from .symbols import Plan, SymbolPlanner

__all__ = ["Definition", "Plan", "Reading", "SymbolPlanner", "mentions", "read"]
