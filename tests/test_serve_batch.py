"""pace-serve's batched decode: concurrent sessions decoded together answer exactly as one at a time.

Two real servers on the tiny fp32 model of ``test_serve`` (its fixtures and helpers): one with the
batched decode (the default, ``--max-batch 4``), one with ``--no-batch-decode``. Concurrent clients send
the same conversations to both; every reply, its usage and its finish reason must be the same, and the
batched server's counters must show that the turns were decoded together (``pace_decode_rows_total``
over ``pace_decode_steps_total`` above 1).
"""

import json
import threading

import pytest

from test_serve import Server, open_stream, tiny_dir  # noqa: F401 - tiny_dir is a fixture

openai = pytest.importorskip("openai")

OPTIONS = ("--max-context", "1024", "--max-resident", "6", "--queue-size", "16")
PROMPTS = ["Session one: define class Ledger with owner and balance.",
           "Session two: the weather in Lyon, in three words. " * 3,
           "Session three: " + "settle the records, then sum the amounts. " * 12,
           "Session four: hi"]


@pytest.fixture(scope="module")
def servers(tiny_dir, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("serve-batch")
    batched = Server(tiny_dir[0], root / "batched", *OPTIONS, "--max-batch", "4")
    serial = Server(tiny_dir[0], root / "serial", *OPTIONS, "--no-batch-decode")
    yield batched, serial
    batched.stop()
    serial.stop()


def together(*calls):
    """Run the calls at once (one thread each); their results in order; any failure re-raised."""
    results, errors = [None] * len(calls), []
    start = threading.Barrier(len(calls))

    def run(i, call):
        try:
            start.wait()
            results[i] = call()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    if errors:
        raise errors[0]
    return results


def chat(srv, messages, session, stream=False, **kw):
    """``(content, finish_reason, completion_tokens, cached_tokens)`` of one request, streamed or not."""
    c = srv.client()
    headers = {"X-Session-Id": session}
    kw.setdefault("max_tokens", 24)
    if not stream:
        r = c.chat.completions.create(model=srv.name, messages=messages, extra_headers=headers, **kw)
        return (r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens,
                r.usage.prompt_tokens_details.cached_tokens)
    chunks = list(c.chat.completions.create(model=srv.name, messages=messages, extra_headers=headers, stream=True,
                                            stream_options={"include_usage": True}, **kw))
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    last = chunks[-1]
    return (content, last.choices[0].finish_reason, last.usage.completion_tokens,
            last.usage.prompt_tokens_details.cached_tokens)


def stop_in(text, at):
    """A 3-character stop string of ``text`` from ``at`` on that is not all whitespace."""
    while not text[at:at + 3].strip() or len(text[at:at + 3]) < 3:
        at += 1
        assert at < len(text), "no stop string could be picked from this reply"
    return text[at:at + 3]


def batching(srv):
    """``(decode steps, rows decoded)`` so far."""
    return srv.metric("pace_decode_steps_total"), srv.metric("pace_decode_rows_total")


def test_four_concurrent_sessions_answer_as_one_at_a_time(servers):
    """Two turns of four sessions, two streamed and two not, all at once: the same replies, usage and
    finish reasons as the server that runs one turn at a time."""
    batched, serial = servers
    steps, rows = batching(batched)
    history = {srv: [[{"role": "user", "content": p}] for p in PROMPTS] for srv in servers}
    for turn in range(2):
        answers = {}
        for srv in servers:
            calls = [lambda srv=srv, i=i: chat(srv, history[srv][i], f"four-{i}", stream=i % 2 == 1, max_tokens=32)
                     for i in range(len(PROMPTS))]
            answers[srv] = together(*calls)
            for i, (content, *_rest) in enumerate(answers[srv]):
                history[srv][i] += [{"role": "assistant", "content": content},
                                    {"role": "user", "content": f"Turn {turn + 2} of session {i}: and then?"}]
        assert answers[batched] == answers[serial]
        assert all(finish == "length" and tokens == 32 for _, finish, tokens, _ in answers[batched])
        if turn == 1:  # the second turn continued each session's cache
            assert all(cached > 0 for *_, cached in answers[batched])
    steps_after, rows_after = batching(batched)
    assert rows_after - rows == 2 * len(PROMPTS) * 31  # every token after each turn's first is decoded in a batch
    assert (rows_after - rows) / (steps_after - steps) > 1.5, "the turns were not decoded together"
    assert batching(serial) == (0, 0)


def read_stream(response, stop_after=None):
    """The content of an SSE chat stream read off a raw response; ``stop_after``: return after that many
    content chunks (the caller then closes the connection)."""
    content, pieces = "", 0
    while True:
        line = response.readline()
        if not line:
            return content
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return content
        chunk = json.loads(data)
        piece = chunk["choices"][0]["delta"].get("content") if chunk.get("choices") else None
        if piece:
            content += piece
            pieces += 1
            if stop_after is not None and pieces >= stop_after:
                return content


def test_a_session_cancelled_mid_batch_leaves_the_other_rows_unchanged(servers):
    """Four long streams decode together; one client leaves after a few pieces. The other three end
    exactly as alone, the turn is counted as cancelled, and the cancelled session's next turn answers as
    if the cut turn had never been (its partial reply was dropped)."""
    batched, serial = servers
    msgs = [[{"role": "user", "content": f"Cancel test {i}: " + p}] for i, p in enumerate(PROMPTS)]
    expected = [chat(serial, m, f"cancel-ref-{i}", max_tokens=120)[0] for i, m in enumerate(msgs)]
    cancelled = batched.metric("pace_cancelled_total")
    steps, rows = batching(batched)
    streams = [open_stream(batched, m, f"cancel-{i}", max_tokens=120) for i, m in enumerate(msgs)]
    got = [None] * len(msgs)

    def leave():
        conn, response = streams[0]
        got[0] = read_stream(response, stop_after=3)
        conn.close()  # mid-batch: the others are still decoding

    def finish(i):
        got[i] = read_stream(streams[i][1])
        streams[i][0].close()

    together(leave, *[lambda i=i: finish(i) for i in range(1, len(msgs))])
    batched.wait_metric("pace_cancelled_total", cancelled + 1)
    assert got[1:] == expected[1:]
    assert expected[0].startswith(got[0]) and got[0] != expected[0]
    steps_after, rows_after = batching(batched)
    assert (rows_after - rows) / (steps_after - steps) > 1.5, "the turns were not decoded together"
    # the cut turn left nothing behind: the same request again answers as the reference
    assert chat(batched, msgs[0], "cancel-0", max_tokens=120)[0] == expected[0]


def test_max_tokens_stop_strings_and_sampling_are_each_turns_own(servers):
    """Four sessions at once, each with its own max_tokens, two with stop strings (streamed and not),
    one sampled: the greedy ones answer as one at a time, to their own lengths and stops."""
    batched, serial = servers
    msgs = [[{"role": "user", "content": f"Limits {i}: " + p}] for i, p in enumerate(PROMPTS)]
    plain = [chat(serial, m, f"limits-ref-{i}", max_tokens=40)[0] for i, m in enumerate(msgs)]
    stops = [None, stop_in(plain[1], len(plain[1]) // 2), stop_in(plain[2], 20), None]
    limits = [5, 40, 40, 17]
    args = [dict(max_tokens=limits[i], **({"stop": [stops[i]]} if stops[i] else {})) for i in range(len(msgs))]
    streamed = [False, True, False, True]
    answers = {}
    for srv in servers:
        calls = [lambda srv=srv, i=i: chat(srv, msgs[i], f"limits-{i}", stream=streamed[i], **args[i])
                 for i in range(len(msgs))]
        calls.append(lambda srv=srv: chat(srv, [{"role": "user", "content": "Sample me."}], "sampled",
                                          max_tokens=40, temperature=0.8, top_p=0.9))
        answers[srv] = together(*calls)
    assert answers[batched][:4] == answers[serial][:4]
    short, cut1, cut2, seventeen, sampled = answers[batched]
    assert short[1:3] == ("length", 5) and plain[0].startswith(short[0])
    assert cut1[0] == plain[1][:plain[1].index(stops[1])] and cut1[1] == "stop" and cut1[2] < 40
    assert cut2[0] == plain[2][:plain[2].index(stops[2])] and cut2[1] == "stop"
    assert seventeen[1:3] == ("length", 17)
    assert sampled[1:3] == ("length", 40) and sampled[0]


def test_a_seed_repeats_its_reply_batched_or_alone(servers):
    """``seed`` was declared and unused: every row sampled from the process-wide generator, so two requests
    with seed 1234 at temperature 1.5 answered differently. Now each seeded row draws from its own
    generator: the same reply alone and batched beside other sampled rows. The one-turn server, which
    has no generator a row, refuses it, and logprobs, by name."""
    batched, serial = servers
    msgs = [{"role": "user", "content": "Seeded: tell me about queues."}]
    hot = dict(temperature=1.5, max_tokens=24)
    alone = chat(batched, msgs, "seed-alone", seed=1234, **hot)
    for attempt in range(3):  # the replies must hold every time; whether the threads' requests met is the OS's
        steps, rows = batching(batched)
        beside = together(lambda: chat(batched, msgs, f"seed-beside-{attempt}", seed=1234, **hot),
                          lambda: chat(batched, msgs, f"seed-other-{attempt}", seed=99, **hot),
                          lambda: chat(batched, [{"role": "user", "content": "Unseeded."}], f"seed-none-{attempt}", **hot))
        steps_after, rows_after = batching(batched)
        assert beside[0][0] == alone[0] and beside[1][0] != alone[0]
        if (rows_after - rows) / (steps_after - steps) > 1.5:
            break
    else:
        pytest.fail("in 3 tries, the three rows were never decoded together")
    for body in ({"seed": 1, "temperature": 1.0}, {"logprobs": True}):
        with pytest.raises(openai.BadRequestError) as e:
            chat(serial, msgs, "seed-serial", **body)
        assert e.value.body["param"] == next(iter(body)) and "--no-batch-decode" in e.value.body["message"]


def test_the_flags_are_checked(tiny_dir, tmp_path, capsys):  # noqa: F811
    from pace_hf.serve.__main__ import main

    with pytest.raises(SystemExit):
        main(["--model", str(tiny_dir[0]), "--store", f"disk:{tmp_path}", "--max-batch", "0"])
    assert "--max-batch must be >= 1" in capsys.readouterr().err


# -- in process: a row that fails fails alone; a session is never in two turns at once ---------------------

def run_turns(engine, turns_spec):
    """Submit ``[(session name, messages, max_tokens)]`` at once; each turn's ``(kind, payload)`` at its end."""
    import asyncio

    from pace_hf.serve.engine import Turn

    async def main():
        loop = asyncio.get_running_loop()
        turns = [Turn(system=None, messages=messages, max_tokens=n, stops=[], sampling={}, session_name=name,
                      loop=loop) for name, messages, n in turns_spec]
        for t in turns:
            engine.submit(t)

        async def end(t):
            while True:
                kind, payload = await asyncio.wait_for(t.events.get(), timeout=120)
                if kind in ("done", "error"):
                    return kind, payload

        return await asyncio.gather(*(end(t) for t in turns))

    return asyncio.run(main())


@pytest.fixture
def engine(tiny_dir):  # noqa: F811
    import torch
    import transformers as tf

    from pace_hf import HostTier, TieredStore
    from pace_hf.serve.engine import Engine

    path, tokenizer = tiny_dir
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eng = Engine(model, tokenizer, TieredStore([HostTier(1 << 30)]), "tiny", max_context=1024, max_resident=6,
                 max_batch=4)
    eng.start()
    yield eng
    eng.close()


def test_a_row_whose_forward_fails_fails_alone(engine, monkeypatch):
    """Session "bad"'s cache raises in its fifth decode forward: its client gets a 500 and its session is
    dropped; the three other rows, decoded in the same batches, answer as in a run without the failure;
    the bad session's next turn is served again (from the messages)."""
    from pace_hf.cache import PACECache

    msgs = [[("user", f"Row {i}: " + p)] for i, p in enumerate(PROMPTS)]
    names = ["good-0", "bad", "good-2", "good-3"]
    clean = run_turns(engine, [(f"clean-{i}", m, 24) for i, m in enumerate(msgs)])
    assert all(kind == "done" for kind, _ in clean)
    original, calls = PACECache.begin_forward, []

    def failing(self, q_len, ids=None):
        if q_len == 1 and self.session_id == "bad":
            calls.append(q_len)
            if len(calls) >= 5:
                raise RuntimeError("injected: this row's cache failed")
        return original(self, q_len, ids)

    monkeypatch.setattr(PACECache, "begin_forward", failing)
    rows = engine.metrics.decode_rows._value.get()
    got = run_turns(engine, [(name, m, 24) for name, m in zip(names, msgs)])
    monkeypatch.setattr(PACECache, "begin_forward", original)
    assert got[1][0] == "error" and got[1][1].status == 500 and "injected" in str(got[1][1].body())
    assert "bad" not in engine.resident and "bad" not in engine.active
    for i in (0, 2, 3):
        assert got[i][0] == "done" and got[i][1]["content"] == clean[i][1]["content"], i
    assert engine.metrics.decode_rows._value.get() - rows > 3 * 23 // 2  # the rows were decoded together
    again = run_turns(engine, [("bad", msgs[1], 24)])
    assert again[0][0] == "done" and again[0][1]["content"] == clean[1][1]["content"]


def test_two_turns_of_one_session_never_run_together(engine):
    """Two turns of one named session sent at once: the second waits for the first (and its save), then
    continues the same session; a third session decodes meanwhile."""
    msgs = [("user", PROMPTS[0])]
    active = []
    original = engine.batcher._step

    def watched():
        names = [row.opened.sid for row in engine.batcher.rows]
        active.append(names)
        original()

    engine.batcher._step = watched
    got = run_turns(engine, [("twice", msgs, 20), ("twice", msgs, 20), ("other", [("user", PROMPTS[1])], 40)])
    assert [kind for kind, _ in got] == ["done"] * 3
    assert got[0][1]["content"] == got[1][1]["content"]  # the second rewound the first's reply and answered again
    assert all(names.count("twice") <= 1 for names in active)
    assert any(set(names) == {"twice", "other"} for names in active)
    assert got[1][1]["reused_tokens"] > 0  # it continued the session the first turn left
