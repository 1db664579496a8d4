"""The paper's benchmarks, beside the library (``pip install pace_hf[bench]``): pace_hf never imports them.

``load_sessions`` generates the coding sessions as a ``datasets.Dataset``; the ``pace_coding`` metric
(``pace_bench.metrics.PACE_CODING``) scores the answers. Modules: ``arms`` (the registry of composed caches),
``runner`` (``pace-bench``: plays sessions per arm), ``ruler`` (``pace-bench --suite ruler``),
``readings`` (what a run reads from a cache), ``progress`` (the phase bar), ``records`` (the JSONL log),
``figures`` (the tables and figures), ``cli`` (shared argument types), ``models`` (offline models), and the
session generator (``sessions``, ``build``, ``facts``, ``spec``, ``amounts``, ``checks``, ``filler``).
"""

from .sessions import (answer_suffix_ids, build_session, load_sessions, reference_solution, session_messages,
                       to_parquet)

__all__ = ["load_sessions", "build_session", "reference_solution", "answer_suffix_ids", "session_messages",
           "to_parquet"]
