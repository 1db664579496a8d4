"""Fast kernels. Each has a plain torch reference beside it and a test that holds them equal.

Triton is an extra (``pip install pace_hf[cuda]``): this package is imported only when a CUDA tensor
reaches a kernel, so the core runs on CPU without it.
"""

try:
    import triton  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the install
    raise ImportError("pace_hf's CUDA kernels need Triton, which the core install leaves out: "
                      "pip install pace_hf[cuda]") from e

from .attention_scores_triton import attention_with_column_sums_triton
from .rerotate_triton import rerotate_triton

__all__ = ["attention_with_column_sums_triton", "rerotate_triton"]
