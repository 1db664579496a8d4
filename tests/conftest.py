import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

if not torch.cuda.is_available():  # Triton kernels run on the CPU through the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
