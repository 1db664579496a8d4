"""``evaluate`` metrics shipped with pace_hf.

``PACE_CODING`` is the path of the ``pace_coding`` metric folder, for
``evaluate.load(PACE_CODING)``. Its scoring functions can also be imported directly
from ``pace_bench.metrics.pace_coding.pace_coding``.
"""

import os

PACE_CODING = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pace_coding")

__all__ = ["PACE_CODING"]
