"""Fast kernels. Each has a plain torch reference beside it and a test that holds them equal.

Triton is an optional dependency (``pip install pace_hf[cuda]``): importing this package needs none,
and a kernel's module (which imports triton) loads on first use, which the library only makes for
CUDA tensors.
"""

import importlib

_KERNELS = {"attention_with_column_sums_triton": ".attention_scores_triton", "rerotate_triton": ".rerotate_triton"}

__all__ = list(_KERNELS)


def __getattr__(name):
    if name not in _KERNELS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = importlib.import_module(_KERNELS[name], __name__)
    except ModuleNotFoundError as e:
        if e.name != "triton":
            raise
        raise ImportError(f"{name} needs Triton, which the core install leaves out: pip install pace_hf[cuda]") from e
    kernel = getattr(module, name)
    globals()[name] = kernel  # importing the submodule bound its name here: rerotate_triton is both
    return kernel
