"""Model fingerprints: one model's KV must never be restored into another.

``model_fingerprint(model_or_config, dtype)`` hashes the model's config (every field, sorted keys, nested
sub-configs included) minus the fields that change from run to run without changing what the KV means
(the checkpoint path, the transformers version, the attention implementation, output/cache switches),
together with the dtype the KV was computed in. Two loads of the same checkpoint in the same dtype get
the same fingerprint in any process; another architecture, size, rope setting or dtype gets another.

What it cannot see: the weights. Two fine-tunes of one base share a config. Pass ``extra=`` (a checkpoint
revision, a hash of the weights) when that matters; it is mixed into the hash.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

# Fields that say where or how a model was loaded, not what it computes.
VOLATILE_FIELDS = frozenset({
    "_name_or_path", "name_or_path", "transformers_version", "_commit_hash",
    "_attn_implementation", "_attn_implementation_internal", "_attn_implementation_autoset",
    "attn_implementation", "_experts_implementation",
    "use_cache", "output_attentions", "output_hidden_states", "return_dict", "torchscript",
    "dtype", "torch_dtype",  # replaced by the dtype argument
})


def _clean(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items() if k not in VOLATILE_FIELDS}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, torch.dtype):
        return str(obj)
    return obj


def _config_of(model_or_config: Any) -> Any:
    config = getattr(model_or_config, "config", None)
    return config if config is not None and hasattr(config, "to_dict") else model_or_config


def _dtype_of(model_or_config: Any, config: Any) -> torch.dtype | None:
    try:
        return next(model_or_config.parameters()).dtype
    except (AttributeError, StopIteration, TypeError):
        pass
    dt = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dt, str):
        dt = getattr(torch, dt.removeprefix("torch."), None)
    return dt if isinstance(dt, torch.dtype) else None


def model_fingerprint(model_or_config: Any, dtype: torch.dtype | str | None = None, *,
                      extra: str | None = None) -> str:
    """A stable hex digest of ``model_or_config``'s config and ``dtype`` (see the module docstring).

    ``model_or_config``: a transformers model (its ``.config`` is used), a ``PretrainedConfig`` or a
    plain dict. ``dtype``: the dtype of the KV (default: the model's parameter dtype, else the config's).
    """
    config = _config_of(model_or_config)
    if dtype is None:
        dtype = _dtype_of(model_or_config, config)
    if hasattr(config, "to_dict"):
        d = config.to_dict()
    elif isinstance(config, dict):
        d = dict(config)
    else:
        raise TypeError(f"cannot fingerprint {type(model_or_config).__name__}: no config")
    doc = {"config": _clean(d), "dtype": str(dtype).removeprefix("torch.") if dtype is not None else None,
           "extra": extra}
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
