"""Fast kernels. Each has a plain torch reference beside it and a test that holds them equal."""

from .attention_scores_triton import attention_with_column_sums_triton
from .rerotate_triton import rerotate_triton

__all__ = ["attention_with_column_sums_triton", "rerotate_triton"]
