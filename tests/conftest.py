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


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A tiny random llama with SmolLM2's tokenizer, saved where ``from_pretrained(path)`` (and so
    ``load_model(path)`` and the servers' ``--model path``) loads it: one per test run."""
    from tiny_models import tiny_model

    from pace_bench.models import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m")
    directory = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture
def code_eval_allowed(monkeypatch):
    """Opt in to running model code (the sandbox refuses without ``PACE_ALLOW_CODE_EVAL=1``)."""
    monkeypatch.setenv("PACE_ALLOW_CODE_EVAL", "1")


def random_ids(n, seed=0):
    """``[1, n]`` seeded random token ids from 3 to 127: the tiny models' vocabulary less the usual pad,
    bos and eos ids."""
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def prefill(model, cache, ids, chunk):
    """Run ``ids`` through ``model`` into ``cache``, ``chunk`` tokens a forward (no grad)."""
    with torch.no_grad():
        for piece in ids.split(chunk, dim=1):
            model(piece, cache=cache)


def assert_capped_gaps(logical: torch.Tensor, physical: torch.Tensor, limit: int) -> None:
    """The bounded layout, head by head: logical order below ``limit``, and each physical gap is the
    logical gap capped at one cap per head (neighbours stay neighbours; a gap under the cap keeps its width)."""
    assert int(physical.max()) < limit
    for log_head, phys_head in zip(logical, physical):
        wide, step = log_head.diff(), phys_head.diff()
        assert (step >= 1).all() and (step <= wide).all()
        squeezed = step < wide
        if squeezed.any():
            cap = int(step[squeezed].max())
            assert (step[squeezed] == cap).all() and (step[wide <= cap] == wide[wide <= cap]).all()


def pytest_terminal_summary(terminalreporter):
    """The documentation's browser checks skipped for want of Chromium are said last, in red: a run
    without the browser must not pass for one that opened every page."""
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if "Chromium is not installed" in str(r.longrepr)]
    if skipped:
        terminalreporter.write_sep("!", f"{len(skipped)} browser checks of the documentation site were SKIPPED: "
                                   "Debian's Chromium is missing (apt-get install chromium; .ci/run installs it)",
                                   red=True, bold=True)
