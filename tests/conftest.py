import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

if not torch.cuda.is_available():  # Triton kernels run on the CPU through the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402


@pytest.fixture
def nothing_loads(monkeypatch):
    """A command-line test's guard: bad input must be refused before any model or tokenizer loads."""
    from pace_bench import models

    def refuse(*args, **kwargs):
        raise AssertionError("a model or tokenizer was loaded")

    monkeypatch.setattr(models, "load_model", refuse)
    monkeypatch.setattr(models, "load_tokenizer", refuse)
