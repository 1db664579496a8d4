"""pace-serve's chunked prefill: one step carries the decoding rows and one chunk of an admitted prompt.

Two in-process engines on the tiny fp32 model of ``test_serve``, one scheduling prefill chunks into the
decode steps (``chunked_prefill=True``), one prefilling each admitted prompt whole between steps
(``chunked_prefill=False``), both with chunks of 16 tokens and a budget the long prompt overflows, so its
cache evicts at every chunk's end. Three sessions decode while a fourth sends a prompt of many
chunks: every greedy reply is the same on both, and no forward of the scheduling engine carries more
than one chunk beside the decoding rows.
"""

import torch

from test_serve import tiny_dir  # noqa: F401 - a fixture
from test_serve_batch import PROMPTS, run_turns

CHUNK = 16
LONG = "Session long: " + "the ledger lists every transfer, its amount and its date. " * 40


def make_engine(tiny_dir, chunked):  # noqa: F811
    import transformers as tf

    from pace_hf import HostTier, TieredStore
    from pace_hf.serve.engine import Engine

    path, tokenizer = tiny_dir
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = Engine(model, tokenizer, TieredStore([HostTier(1 << 30)]), "tiny", budget=160, chunk=CHUNK,
                    max_context=2048, max_resident=6, max_batch=4, chunked_prefill=chunked)
    engine.start()
    return engine


def forwards(engine):
    """The tokens of every forward the engine's model runs from now on (a list that fills)."""
    sizes = []
    engine.model.register_forward_pre_hook(lambda module, args, kwargs: sizes.append(kwargs["input_ids"].numel()),
                                           with_kwargs=True)
    return sizes


def test_a_long_prompt_beside_three_decoding_sessions_answers_as_prefilled_whole(tiny_dir):  # noqa: F811
    turns = [(f"short-{i}", [("user", p)], 48) for i, p in enumerate(PROMPTS[:3])] + [("long", [("user", LONG)], 24)]
    replies = {}
    for chunked in (True, False):
        engine = make_engine(tiny_dir, chunked)
        try:
            sizes = forwards(engine)
            got = run_turns(engine, turns)
        finally:
            engine.close()
        assert [kind for kind, _ in got] == ["done"] * 4, got
        replies[chunked] = [payload["content"] for _, payload in got]
        if chunked:
            scheduled = sizes
    assert replies[True] == replies[False]
    long_prompt = got[3][1]["prompt_tokens"]
    assert long_prompt > 3 * 160  # three budgets: its cache evicted at its chunks' ends
    assert max(scheduled) <= CHUNK + 3  # one chunk beside at most three decoding rows
    assert scheduled.count(CHUNK + 3) >= 8  # the long prompt's chunks went along with the three decoding rows
