"""The paper's benchmark: long agent sessions with late coding probes.

``load_sessions`` generates the sessions as a ``datasets.Dataset``; the ``pace_coding``
metric (``pace_hf.metrics.PACE_CODING``) scores the answers.
"""

from .sessions import (answer_suffix_ids, build_session, load_sessions, reference_solution, session_messages,
                       to_parquet)

__all__ = ["load_sessions", "build_session", "reference_solution", "answer_suffix_ids", "session_messages",
           "to_parquet"]
