"""Fast kernels. Each has a plain torch reference beside it and a test that holds them equal."""

from .rerotate_triton import rerotate_triton

__all__ = ["rerotate_triton"]
