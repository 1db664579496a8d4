"""SymbolPlanner on real code as agents print it (issue 24): definition-level spans within a budget, tool
output formats, namespaces and resolution, remarks, closure, and plans in prose.

Sessions are built from the standard library's own source (``inspect.getsource``) and tokenized with
SmolLM2's tokenizer under its chat template, so every span is an exact token range."""

import argparse
import inspect
import json
import textwrap

import pytest

from pace_hf.chat import ChatTemplate
from pace_hf.planner import SymbolPlanner
from pace_hf.planner.prose import by_role
from pace_hf.session import Message


def _load_tokenizer():
    try:
        from pace_bench.models import load_tokenizer
    except ImportError:
        from pace_hf.bench.models import load_tokenizer
    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def template():
    return ChatTemplate(_load_tokenizer())


class Session:
    """Messages with their exact token spans; ``tokens(k, text)`` is the token range of ``text`` in
    message ``k``."""

    def __init__(self, template, *turns):
        self.template, self.messages, at, step = template, [], len(template.system_ids), 0
        for role, content in turns:
            step += role == "user"
            n = len(template.encode(template.block(role, content)))
            self.messages.append(Message(len(self.messages), role, content, at, at + n, step))
            at += n

    def tokens(self, k: int, text: str) -> tuple[int, int]:
        m = self.messages[k]
        a = m.content.index(text)
        offsets, _, at = self.template.content_offsets(m.role, m.content)
        s, e = offsets.span(a + at, a + len(text) + at)
        return m.start + s, m.start + e

    def plan(self, steps, budget=2048, **kw):
        return SymbolPlanner(steps, **kw).blueprint_for(self.messages, template=self.template, budget=budget)


def planned(plan, step) -> list[tuple[int, int]]:
    return sorted((s.start, s.end) for s in plan if step in s.readers)


def covered(spans, target) -> float:
    """The share of ``target``'s tokens inside ``spans``."""
    inside = sum(max(0, min(target[1], e) - max(target[0], s)) for s, e in spans)
    return inside / (target[1] - target[0])


def size(spans) -> int:
    return sum(e - s for s, e in spans)


def assert_found(sess, plan, step, k, source, tight=2.0):
    """``source`` (in message ``k``) is planned for ``step`` (>= 90% of its tokens), and the step's plan is
    at most ``tight`` times its size: the definition, not the message."""
    target = sess.tokens(k, source)
    got = planned(plan, step)
    assert covered(got, target) >= 0.9, (step, got, target)
    assert size(got) <= tight * (target[1] - target[0]), (size(got), target)


TEXTWRAP = inspect.getsource(textwrap)
DEDENT = inspect.getsource(textwrap.dedent)


def cat(path, text):
    return [("assistant", f"$ cat {path}"), ("tool", text)]


# ------------------------------------------------------------------------------------------ spans


def test_a_step_plans_the_definition_not_the_file(template):
    sess = Session(template, ("user", "Task: read the code."), *cat("textwrap.py", TEXTWRAP))
    plan = sess.plan({2: "Write a test for `dedent`.", 3: "Explain `TextWrapper.wrap`.",
                      4: "What is `_whitespace_only_re`?"})
    assert_found(sess, plan, 2, 2, DEDENT)
    method = inspect.getsource(textwrap.TextWrapper.wrap)
    assert_found(sess, plan, 3, 2, method.strip(), tight=2.5)  # the method and its class's header line
    header = sess.tokens(2, "class TextWrapper:")
    assert covered(planned(plan, 3), header) == 1.0
    assert_found(sess, plan, 4, 2, "_whitespace_only_re = re.compile('^[ \\t]+$', re.MULTILINE)")
    assert size(planned(plan, 2)) < (sess.messages[2].end - sess.messages[2].start) / 10


def test_decorators_are_part_of_the_definition(template):
    source = inspect.getsource(json.JSONEncoder)
    text = "import functools\n\n\n@functools.lru_cache(maxsize=None)\ndef cached_encoder(indent):\n" \
           "    return JSONEncoder(indent=indent)\n\n\n" + source
    sess = Session(template, ("user", "Task."), *cat("enc.py", text))
    plan = sess.plan({2: "Change `cached_encoder`."})
    assert_found(sess, plan, 2, 2, "@functools.lru_cache(maxsize=None)\ndef cached_encoder(indent):\n"
                                   "    return JSONEncoder(indent=indent)")


def test_a_plan_over_the_share_of_the_budget_is_cut_and_says_what_it_dropped(template):
    sess = Session(template, ("user", "Task."), *cat("textwrap.py", TEXTWRAP))
    plan = SymbolPlanner({2: "Rewrite `TextWrapper`, `dedent`, `indent`, `wrap`, `fill` and `shorten`."}) \
        .blueprint_for(sess.messages, template=template, budget=600)
    assert plan.cap == 300 and size(planned(plan, 2)) <= 300
    # the 3K-token class did not fit whole: at most a digest of it, in the room the others left
    assert "TextWrapper" in {n.definition.name for n in plan.dropped + plan.partial}
    assert {n.definition.name for n in plan.needs} & {"dedent", "indent", "wrap", "fill", "shorten"}
    for need in plan.dropped:  # nothing dropped silently: every need is either kept or listed
        assert need not in plan.needs


def signature(source: str) -> str:
    """The ``def`` line of a method's source, stripped."""
    return next(line for line in source.split("\n") if line.lstrip().startswith("def ")).strip()


def test_a_class_too_large_for_its_step_is_planned_as_a_digest(template):
    sess = Session(template, ("user", "Task."), *cat("textwrap.py", TEXTWRAP))
    whole = sess.tokens(2, inspect.getsource(textwrap.TextWrapper).strip())
    assert whole[1] - whole[0] > 1024  # over the step's cap at B = 2,048
    plan = sess.plan({2: "Refactor `TextWrapper` and the `wrap` function."})  # wrap: a function and a member
    got = planned(plan, 2)
    assert [n.definition.name for n in plan.partial] == ["TextWrapper"] and not plan.dropped
    assert 300 < size(got) <= 1024
    assert covered(got, sess.tokens(2, inspect.getsource(textwrap.wrap).strip())) == 1.0  # whole, it fits
    assert covered(got, sess.tokens(2, "class TextWrapper:")) == 1.0
    assert covered(got, sess.tokens(2, inspect.getsource(textwrap.TextWrapper.wrap).strip())) == 1.0
    for member in (textwrap.TextWrapper._split_chunks, textwrap.TextWrapper.fill):
        assert covered(got, sess.tokens(2, signature(inspect.getsource(member)))) == 1.0
    assert covered(got, whole) < 0.5


def test_a_class_named_with_its_member_plans_the_members_context(template):
    sess = Session(template, ("user", "Task."), *cat("textwrap.py", TEXTWRAP))
    plan = sess.plan({2: "Subclass `TextWrapper` and override `_split_chunks`.",
                      3: "Speed up the text wrapper's split chunks method.", 4: "Fix the chunk splitting."})
    method = inspect.getsource(textwrap.TextWrapper._split_chunks).strip()
    for step in (2, 3, 4):  # in code, in words, in other words: the member and its class's header
        got = planned(plan, step)
        assert covered(got, sess.tokens(2, method)) == 1.0
        assert covered(got, sess.tokens(2, "class TextWrapper:")) == 1.0
        assert size(got) < 250  # not the 3K-token class
    for step in (2, 3):  # with its class named: also what the member uses on self
        assert covered(planned(plan, step), sess.tokens(2, signature(inspect.getsource(textwrap.TextWrapper._split)))) == 1.0
    assert not plan.partial and not plan.dropped


SUBCLASS = """from base import HelpFormatter as _Formatter


class QuietFormatter(_Formatter):
    \"\"\"Help without the usage line.\"\"\"

    def _format_usage(self, usage, actions, groups, prefix):
        return ''
"""


def test_an_inherited_member_resolves_through_the_subclass_and_its_imports(template):
    base = inspect.getsource(argparse.HelpFormatter)
    parser = inspect.getsource(argparse.ArgumentParser)  # defines its own format_help, later
    sess = Session(template, ("user", "Task."), *cat("base.py", base), *cat("quiet.py", SUBCLASS),
                   *cat("parser.py", parser))
    method = inspect.getsource(argparse.HelpFormatter.format_help).strip()
    plan = sess.plan({2: "Subclass `QuietFormatter` and override `format_help`.",
                      3: "Extend `QuietFormatter.format_help` to log.", 4: "Explain `format_help`."})
    for step in (2, 3):
        got = planned(plan, step)
        assert covered(got, sess.tokens(2, method)) == 1.0
        assert covered(got, sess.tokens(4, "class QuietFormatter(_Formatter):")) == 1.0
        assert covered(got, sess.tokens(6, inspect.getsource(argparse.ArgumentParser.format_help).strip())) == 0
    # alone, a bare member name is the latest one the session defines
    assert covered(planned(plan, 4), sess.tokens(6, inspect.getsource(argparse.ArgumentParser.format_help).strip())) == 1.0


def test_a_definition_named_by_its_role(template):
    source = inspect.getsource(json.decoder)
    sess = Session(template, ("user", "Task."), *cat("decoder.py", source))
    plan = sess.plan({2: "Review the decoder class."})
    got = planned(plan, 2)
    assert covered(got, sess.tokens(2, inspect.getsource(json.decoder.JSONDecoder).strip())) >= 0.9
    assert covered(got, sess.tokens(2, inspect.getsource(json.decoder.JSONDecodeError).strip())) == 0.0
    heads = {("class", "decod"): {"JSONDecoder"}}
    assert by_role(("the", "decoder", "class"), heads) == {"JSONDecoder"}
    assert by_role(("a", "decoder", "class"), heads) == set()  # no reference: a description's words


# ------------------------------------------------------------------------------------------ tool output


def numbered(text, fmt):
    return "\n".join(fmt.format(n=n, line=line) for n, line in enumerate(text.split("\n"), 1))


@pytest.mark.parametrize("fmt", ["{n:6d}\t{line}", "{n:>6}→{line}", "{n}:{line}"], ids=["cat-n", "arrow", "colon"])
def test_line_numbered_listings_are_code(template, fmt):
    listing = numbered(TEXTWRAP, fmt)
    sess = Session(template, ("user", "Task."), ("assistant", "$ cat -n textwrap.py"), ("tool", listing))
    plan = sess.plan({2: "Write a test for `dedent`."})
    first = DEDENT.split("\n")[0]
    last_line = [line for line in DEDENT.split("\n") if line.strip()][-1]
    start = listing.index(first)
    end = listing.index(last_line, start) + len(last_line)
    assert_found(sess, plan, 2, 2, listing[start:end])


def test_grep_hits_and_diffs_are_code(template):
    lines = TEXTWRAP.split("\n")
    n0 = next(i for i, line in enumerate(lines) if line.startswith("def dedent"))
    n1 = n0 + len(DEDENT.rstrip("\n").split("\n"))
    grep = "\n".join(f"Lib/textwrap.py{':' if i == n0 else '-'}{i + 1}{':' if i == n0 else '-'}{lines[i]}"
                     for i in range(n0 - 2, n1))
    body = "\n".join(" " + line for line in DEDENT.rstrip("\n").split("\n"))
    diff = (f"diff --git a/Lib/textwrap.py b/Lib/textwrap.py\n--- a/Lib/textwrap.py\n+++ b/Lib/textwrap.py\n"
            f"@@ -{n0 + 1},3 +{n0 + 1},4 @@\n" + body.replace(" def dedent(text):", "-def dedent(text, old):\n+def dedent(text):", 1))
    sess = Session(template, ("user", "Task."), ("assistant", "$ grep -n -A40 'def dedent' Lib/textwrap.py"),
                   ("tool", grep), ("assistant", "$ git diff"), ("tool", diff), ("user", "Next."))
    plan = sess.plan({2: "Explain `dedent`.", 3: "Explain `dedent` again."})
    got = planned(plan, 2)
    # the latest definition before step 2 is the diff's new side
    new_side = sess.tokens(4, diff[diff.index("+def dedent") + 1:])
    assert covered(got, new_side) >= 0.9
    assert covered(got, sess.tokens(4, "-def dedent(text, old):")) < 0.5
    assert size(got) < 1.2 * (new_side[1] - new_side[0])
    sess2 = Session(template, ("user", "Task."), ("assistant", "$ grep"), ("tool", grep))
    plan2 = sess2.plan({2: "Explain `dedent`."})
    assert_found(sess2, plan2, 2, 2, grep[grep.index("def dedent"):])


def test_markdown_fences_and_notebook_cells_are_code(template):
    markdown = "Here is the helper I found:\n\n```python\n" + DEDENT + "```\n\nIt removes common indentation."
    cells = {"cells": [{"cell_type": "markdown", "metadata": {}, "source": ["# Notes\n"]},
                       {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": 1,
                        "source": [line + "\n" for line in DEDENT.rstrip("\n").split("\n")]}],
             "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    notebook = json.dumps(cells, indent=1, ensure_ascii=False)
    for text, first in ((markdown, "def dedent"), (notebook, '"def dedent')):
        sess = Session(template, ("user", "Task."), ("assistant", "$ cat notes"), ("tool", text))
        plan = sess.plan({2: "Explain `dedent`."})
        last = DEDENT.rstrip("\n").split("\n")[-1].strip()
        if text is notebook:
            last = json.dumps(DEDENT.rstrip("\n").split("\n")[-1] + "\n")[1:-1].strip()
        start = text.index(first)
        assert_found(sess, plan, 2, 2, text[start:text.index(last, start) + len(last)], tight=1.6)


FENCED_DOCSTRING = '''"""Loading helpers.

Example:

```py
>>> from loaders import load_table
>>> table = load_table("data.csv")
```
"""
import csv

DEFAULT_DELIMITER = ","


def load_table(path, delimiter=DEFAULT_DELIMITER):
    """Read a table.

    ```python
    rows = load_table("x.csv")
    ```
    """
    with open(path) as f:
        return list(csv.reader(f, delimiter=delimiter))


class TableWriter:
    def write(self, rows):
        return len(rows)
'''


@pytest.mark.parametrize("cut", [False, True], ids=["whole", "cut-mid-file"])
def test_a_fence_inside_a_docstring_is_not_the_code(template, cut):
    text = FENCED_DOCSTRING + ("\n\ndef broken(a,\n" if cut else "")  # cut: the file no longer parses
    sess = Session(template, ("user", "Task."), *cat("loaders.py", text))
    plan = sess.plan({2: "Test `load_table`.", 3: "Test `TableWriter.write`."})
    assert_found(sess, plan, 2, 2, text[text.index("def load_table"):text.index("delimiter=delimiter))") + 21])
    assert covered(planned(plan, 3), sess.tokens(2, "    def write(self, rows):\n        return len(rows)")) == 1.0


# ------------------------------------------------------------------------------------------ resolution


def test_top_level_names_and_members_are_separate_namespaces(template):
    wrap_function = inspect.getsource(textwrap.wrap)
    wrapper_class = inspect.getsource(textwrap.TextWrapper)  # defines a member wrap, later
    sess = Session(template, ("user", "Task."), *cat("a.py", wrap_function), *cat("b.py", wrapper_class))
    plan = sess.plan({2: "Call `wrap`.", 3: "Fix `TextWrapper.wrap`."})
    assert_found(sess, plan, 2, 2, wrap_function.strip())
    assert_found(sess, plan, 3, 4, inspect.getsource(textwrap.TextWrapper.wrap).strip(), tight=1.3)
    assert covered(planned(plan, 3), sess.tokens(2, wrap_function.strip())) == 0.0


def test_a_member_resolves_through_bases_defined_later(template):
    sub = inspect.getsource(argparse.RawDescriptionHelpFormatter)
    base = inspect.getsource(argparse.HelpFormatter)
    sess = Session(template, ("user", "Task."), *cat("sub.py", sub), *cat("base.py", base))
    plan = sess.plan({2: "Explain `RawDescriptionHelpFormatter.format_help`.",
                      3: "Explain `RawDescriptionHelpFormatter._fill_text`."})
    method = inspect.getsource(argparse.HelpFormatter.format_help).strip()
    assert_found(sess, plan, 2, 4, method, tight=1.5)
    assert_found(sess, plan, 3, 2, inspect.getsource(argparse.RawDescriptionHelpFormatter._fill_text).strip(),
                 tight=1.5)  # the override, not the base's


def test_a_module_qualified_name_goes_through_the_import_alias(template):
    shorten = inspect.getsource(textwrap.shorten)
    other = "def shorten(name):\n    return name[:3]\n"  # a later, unrelated shorten
    sess = Session(template, ("user", "Task."), ("assistant", "$ cat app.py"),
                   ("tool", "import textwrap as tw\n\nprint(tw.shorten('abc', 2))\n"),
                   *cat("Lib/textwrap.py", TEXTWRAP), *cat("names.py", other))
    plan = sess.plan({2: "Explain `tw.shorten`.", 3: "Explain `textwrap.shorten`.", 4: "Explain `shorten`."})
    assert_found(sess, plan, 2, 4, shorten.strip())
    assert_found(sess, plan, 3, 4, shorten.strip())
    assert_found(sess, plan, 4, 6, other.strip(), tight=3)  # bare: the latest wins


def test_a_name_the_session_defines_counts_even_if_it_is_a_builtin(template):
    text = ('def print(*objects, sep=" ", end="\\n"):\n    """Print with markup."""\n    return objects\n\n\n'
            'class With:\n    def open(self, path):\n        return path\n')
    sess = Session(template, ("user", "Task."), *cat("console.py", text))
    plan = sess.plan({2: "Wrap `print`.", 3: "Test `With`.", 4: "Fix `With.open`."})
    assert_found(sess, plan, 2, 2, text[:text.index("return objects") + 14])
    assert_found(sess, plan, 3, 2, text[text.index("class With"):].rstrip())
    assert covered(planned(plan, 4), sess.tokens(2, "    def open(self, path):\n        return path")) == 1.0


def test_a_remark_is_a_mention_not_a_definition(template):
    sess = Session(template, ("user", "Task."), *cat("textwrap.py", TEXTWRAP),
                   ("assistant", "`dedent` is defined in `textwrap.py`. `dedent` is the helper we need."))
    plan = sess.plan({2: "Write a test for `dedent`."})
    assert_found(sess, plan, 2, 2, DEDENT)
    assert covered(planned(plan, 2), (sess.messages[3].start, sess.messages[3].end)) == 0.0


def test_the_closure_follows_a_record_field_not_any_attribute_name(template):
    text = ("class Response:\n    def __init__(self):\n        self.headers = {}\n\n\n"
            "class Request:\n    def __init__(self):\n        self.headers = {}\n\n\n"
            "def content_type(response):\n    return response.headers.get('content-type')\n")
    sess = Session(template, ("user", "Task."), *cat("models.py", text))
    plan = sess.plan({2: "Fix `content_type`."})
    assert_found(sess, plan, 2, 2, text[text.index("def content_type"):].rstrip())  # no class: headers is ambiguous
    record = "from dataclasses import dataclass\n\n\n@dataclass\nclass Invoice:\n    status: str\n    total: int\n"
    settle = "def settle(invoice):\n    invoice.status = 'paid'\n    return invoice.total\n"
    sess = Session(template, ("user", "Task."), *cat("models.py", record), *cat("billing.py", settle))
    plan = sess.plan({2: "Write `settle` again."})
    assert covered(planned(plan, 2), sess.tokens(2, record[record.index("@dataclass"):].rstrip())) == 1.0
    assert covered(planned(plan, 2), sess.tokens(4, settle.rstrip())) == 1.0
    literal_only = planned(sess.plan({2: "Write `settle` again."}, depth=0), 2)
    assert covered(literal_only, sess.tokens(2, record[record.index("@dataclass"):].rstrip())) == 0.0


# ------------------------------------------------------------------------------------------ prose


VERSIONS = '''import re

VERSION_PATTERN = r"v?(?P<release>[0-9]+(?:\\.[0-9]+)*)"


def parse_version(text):
    """Split a version string into its release numbers."""
    return tuple(int(p) for p in re.match(VERSION_PATTERN, text).group("release").split("."))


class VersionParser:
    """Parses many version strings at once."""

    def parse_all(self, texts):
        return [parse_version(t) for t in texts]


def dispatch(event, handlers):
    """Call every handler registered for the event, in order of registration."""
    for handler in handlers.get(event, []):
        handler(event)
'''


@pytest.mark.parametrize("words,name", [
    ("Fix how we parse version strings with a local tag.", "def parse_version"),
    ("Make parseVersion accept a leading v.", "def parse_version"),
    ("The version parser is slow; speed it up.", "class VersionParser"),
    ("Fix the dispatch function.", "def dispatch"),
    ("Something calls every handler registered for an event; make it skip failures.", "def dispatch"),
    # requests' extract_cookies_to_jar, described by its docstring: CookieJar is imported, not defined here
    ("Find the function that does this: Call every handler registered for the event with a CookieJar.",
     "def dispatch"),
], ids=["spaced-words", "camel-for-snake", "class-as-words", "lowercase-word", "description",
        "description-naming-an-import"])
def test_plans_in_prose(template, words, name):
    sess = Session(template, ("user", "Task."), *cat("versions.py", VERSIONS))
    plan = sess.plan({2: words}, depth=0)
    start = VERSIONS.index(name)
    end = VERSIONS.find("\n\n\n", start)
    assert_found(sess, plan, 2, 2, VERSIONS[start:end if end > 0 else len(VERSIONS)].rstrip())


# ------------------------------------------------------------------------------------------ offsets, rehydration


def test_token_offsets_match_a_scan_of_every_token(template):
    from pace_hf.chat import TokenOffsets

    enc = template.tok(TEXTWRAP, add_special_tokens=False, return_offsets_mapping=True)
    offsets = TokenOffsets(enc["offset_mapping"])
    for a, b in [(0, 1), (10, 400), (5000, 5003), (len(TEXTWRAP) - 7, len(TEXTWRAP)), (123, 124)]:
        scan = [i for i, (s, e) in enumerate(enc["offset_mapping"]) if s < b and e > a and e > s]
        assert offsets.span(a, b) == (scan[0], scan[-1] + 1)


def test_rehydration_restores_the_definition_a_turn_names_not_its_file(template):
    from types import SimpleNamespace

    from test_planner import FakeCache

    sess = Session(template, ("user", "Task."), *cat("textwrap.py", TEXTWRAP), ("user", "Why does `dedent` fail?"))
    turn = sess.messages[-1]
    cache = FakeCache(resident=(), seen=turn.start, budget=4096)
    session = SimpleNamespace(messages=sess.messages, cache=cache, step=turn.step, template=template)
    spans = SymbolPlanner().rehydrate(session, turn)
    target = sess.tokens(2, DEDENT)
    restored = [(s, e) for s, e, _ in cache.restored]
    assert covered(restored, target) >= 0.9 and size(restored) <= 2 * (target[1] - target[0])
    assert all(s.readers == (turn.step,) for s in spans)


def test_any_text_is_read_never_a_crash():
    """Cut, spliced and garbled source (a lone carriage return, a stray fence, half a notebook) is read
    as what it is: definitions whose spans lie inside the text, or none."""
    import random

    from pace_hf.planner import mentions, read

    rng = random.Random(0)
    junk = ["```python\n", "```", '"""', "\r", "  12→", "x.py:3:", "@@ -1,2 +1,3 @@\n", '{"cells": [', "<cell>",
            "\u2028", "def f(", "class C(B):\n    x: int = 1\n"]
    for _ in range(150):
        a = rng.randrange(len(TEXTWRAP))
        text = TEXTWRAP[a:a + rng.randrange(50, 3000)]
        for _ in range(rng.randrange(4)):
            k = rng.randrange(len(text) + 1)
            text = text[:k] + rng.choice(junk) + text[k:]
        mentions(text)
        for d in read(text).definitions:
            assert all(0 <= s <= e <= len(text) for s, e in d.parts), (text, d)
    # texts CPython's own parser refuses beyond a SyntaxError: 3,000 bare words (MemoryError), deep nesting
    for text in ("word " * 3000, "(" * 5000, "[" * 300 + "]" * 300, "\0def f(): pass"):
        mentions(text)
        read(text)


def test_the_live_plan_keeps_the_soonest_readers_and_brings_the_rest_back_later(template):
    sess = Session(template, ("user", "Task."), *cat("textwrap.py", TEXTWRAP))
    names = {2: "indent", 3: "shorten", 4: "fill", 5: "wrap"}
    sources = {k: inspect.getsource(getattr(textwrap, v)).strip() for k, v in names.items()}
    sizes = {k: sess.tokens(2, v)[1] - sess.tokens(2, v)[0] for k, v in sources.items()}
    budget = 2 * max(sizes.values())  # each step fits in budget // 2, the four together not in budget
    assert sum(sizes.values()) > budget
    planner = SymbolPlanner({k: f"Test `{v}`." for k, v in names.items()})
    early = planner.blueprint_for(sess.messages, template=template, budget=budget, now=1)
    dropped = {n.step for n in early.dropped}
    assert dropped and min(dropped) > 2  # the farthest readers give way, never the next one
    assert size(sorted((s.start, s.end) for s in early)) <= budget
    assert covered(planned(early, 2), sess.tokens(2, sources[2])) >= 0.9
    later = planner.blueprint_for(sess.messages, template=template, budget=budget, now=max(dropped) - 1)
    assert covered(planned(later, max(dropped)), sess.tokens(2, sources[max(dropped)])) >= 0.9  # back


def test_a_description_that_names_another_definition_still_finds_the_one_it_describes(template):
    # shlex's join, described by what its docstring says: the step names split, which the session defines
    # too, so the literal name alone would plan only the function it is the inverse of
    import shlex

    source = inspect.getsource(shlex)
    sess = Session(template, ("user", "Task."), *cat("shlex.py", source))
    step = "The inverse of `split`: it returns a shell-escaped string from a split command. Make it accept a tuple."
    got = planned(sess.plan({2: step}, depth=0), 2)
    start = source.index("def join")
    target = sess.tokens(2, source[start:source.index("\n\n\n", start)].rstrip())
    assert covered(got, target) >= 0.9, (got, target)
    file = sess.messages[2]
    assert size(got) < 0.1 * (file.end - file.start)  # the definitions (join, and the split it names), not the file


# ------------------------------------------------------------------------------ issue 55: third pass
import ast  # noqa: E402
import dataclasses  # noqa: E402
import fnmatch  # noqa: E402
import json.decoder  # noqa: E402
import plistlib  # noqa: E402
import posixpath  # noqa: E402
import queue  # noqa: E402
import quopri  # noqa: E402
import tokenize  # noqa: E402

from pace_hf.planner.symbols import DERIVED, _Index  # noqa: E402


def _source(function) -> str:
    """A function's source read from its module's file (frozen modules such as posixpath have no
    ``inspect.getsource`` of their functions)."""
    text = inspect.getsource(inspect.getmodule(function))
    node = next(n for n in ast.parse(text).body if getattr(n, "name", None) == function.__name__)
    return ast.get_source_segment(text, node)


def _session_of(template, *modules):
    turns = [("user", "Task: read the code.")]
    for m in modules:
        turns += cat(m.__name__.replace(".", "/") + ".py", inspect.getsource(m))
    return Session(template, *turns)


def _position(sess, module) -> int:
    return next(k for k, m in enumerate(sess.messages) if m.content == inspect.getsource(module))


@pytest.mark.parametrize("step, functions", [
    ("After relpath runs, the cache gets stale data.", [posixpath.relpath]),
    ("fnmatchcase should stop swallowing errors raised by splitext", [fnmatch.fnmatchcase, posixpath.splitext]),
])
def test_bare_names_in_prose_are_planned(template, step, functions):
    """A plain word that is a name the session defines, and no English word, is that name."""
    sess = _session_of(template, posixpath, fnmatch)
    plan = sess.plan({2: step})
    for f in functions:
        assert_found(sess, plan, 2, _position(sess, inspect.getmodule(f)), _source(f), tight=2 * len(functions))


def test_an_english_name_needs_the_grammar_of_a_thing(template):
    """``get`` and ``put`` are English words in queue.py's own prose: a verb or a common noun is no name,
    a subject is, when it is the step's only candidate."""
    sess = _session_of(template, queue)
    index, planner, k = _Index(sess.messages), SymbolPlanner(), len(sess.messages)
    assert index.english("put") and not index.english("qsize")

    def bare(text):
        return {n.definition.name for n in planner.needs(index, text, 2, k) if n.how == DERIVED}

    assert "put" in bare("Make sure put handles a full queue.")
    assert "qsize" in bare("Then wrap qsize in a lock.")  # not English here: a name wherever it stands
    assert not bare("Then get a summary and put it in the notes.") & {"get", "put"}  # verbs
    assert not bare("Make sure put handles it, and that get raises.")  # two candidates: neither
    assert not bare("Callers should qsize twice.") & {"qsize"}  # after a modal: a verb
    # where the grammar still makes it a thing: a question's subject, a verb's object with no
    # determiner, any preposition's object; and of two candidates, the one a common noun rarely stands as
    assert "qsize" in bare("Can qsize be made thread safe?")  # the modal opens a question: no verb follows it
    assert "put" in bare("Should put validate its arguments first?")
    assert "put" in bare("I changed put and it broke.")
    assert "put" in bare("We rely on put.")
    assert "put" in bare("Once put returns, the caller must close the queue.")  # "the queue": a common noun
    assert not bare("Please get a summary.") & {"get"}  # a sentence adverb, then the verb
    assert not bare("Users put the result in a file.") & {"put"}  # a plural subject, then its verb
    # a perfect's object is a thing even in a sentence of many content words, where only the strict
    # places count: after "has" comes a participle, not an adjective ("the parsed value")
    assert "put" in bare("Nobody has tested put with unicode input yet.")
    assert not bare("Nobody tested the put with unicode input yet, nor the wrapper.") & {"put"}
    # among many content words, a verb's object or a preposition's is also a name when the word is
    # among the step's best lexical matches; after a determiner it stays a common noun
    assert "put" in bare("I changed put yesterday and now the build fails.")
    assert "put" in bare("There is a race between put and the cleanup thread.")
    assert not bare("The build fails whenever the put of another thread runs twice.") & {"put"}
    # a question word's auxiliary: its subject comes next; a pronoun's verb, a modal's verb, and an "-s"
    # verb after a noun: their object
    assert "put" in bare("How often is put called per request?")
    assert "qsize" in bare("Let us memoize qsize.") and "put" in bare("We should inline put into its caller.")
    assert "put" in bare("The new release deprecates put.")
    assert not bare("We put the result in a file.") & {"put"}  # after a pronoun: a verb
    assert "put" in bare("The bug report blames put for the memory spike.")  # an object, not "put for"
    assert "qsize" in bare("Port qsize to the async API.")  # "API" is no code the session defines
    assert not bare("The tests put the result in a file.") & {"put"}  # "the tests": a plural noun's verb
    # the verb of a plural subject takes an object; "both" and a preposition are followed by a thing, not
    # a verb ("for put that covers"); a word that is no English word is no infinitive after "to"
    assert "put" in bare("Our metrics show put near the top of the profile.")
    assert "put" in bare("Both put and its tests need an update.")
    assert "put" in bare("Write a docstring for put that covers every path.")
    assert "qsize" in bare("Add a timeout to qsize so it cannot block forever.")
    assert not bare("Remember to put the lock back.") & {"put"}  # an infinitive


def test_a_name_that_is_a_stopword_or_a_kind_word(template):
    """``write`` is a stopword to the ranker, yet a common name of code: where the grammar makes it a
    thing it is the name. ``fields`` is also a kind word: after an adjective it is that word ("the
    local fields"), after a preposition the name."""
    def bare_in(module):
        sess = _session_of(template, module)
        index, planner, k = _Index(sess.messages), SymbolPlanner(), len(sess.messages)
        return lambda text: {n.definition.name for n in planner.needs(index, text, 2, k) if n.how == DERIVED}

    bare = bare_in(plistlib)
    assert "write" in bare("I suspect write is leaking memory; check it.")
    assert not bare("Then write the result down.") & {"write"}  # a verb
    bare = bare_in(dataclasses)
    assert bare("Rename the local fields inside replace.") == {"replace"}
    assert "fields" in bare("We rely on fields in production.")


def test_a_large_function_is_planned_as_a_digest_in_any_format(template):
    source = inspect.getsource(tokenize)
    body = inspect.getsource(tokenize._tokenize).rstrip("\n")
    lines = source.rstrip("\n").split("\n")
    numbered = "\n".join(f"{n:6d}\t{line}" for n, line in enumerate(lines, 1))
    diff = f"--- /dev/null\n+++ b/tokenize.py\n@@ -0,0 +1,{len(lines)} @@\n" + "".join(f"+{x}\n" for x in lines)
    for text in (source, numbered, diff):
        sess = Session(template, ("user", "Task."), ("assistant", "$ show tokenize.py"), ("tool", text))
        whole = sess.tokens(2, body.split("\n")[0]), sess.tokens(2, body.split("\n")[-1])
        assert whole[1][1] - whole[0][0] > 1024
        plan = sess.plan({2: "Refactor `_tokenize`: how it handles `parenlev`."})
        got = planned(plan, 2)
        assert [n.definition.name for n in plan.partial] == ["_tokenize"] and not plan.dropped
        assert 512 < size(got) <= 1024
        assert all(whole[0][0] <= s and e <= whole[1][1] for s, e in got)  # inside the function
        assert covered(got, sess.tokens(2, "def _tokenize(readline, encoding):")) == 1.0
        uses = next(line.strip() for line in body.split("\n")[100:] if "parenlev" in line)  # late in the body
        assert covered(got, sess.tokens(2, uses)) == 1.0


def test_every_need_over_the_room_gets_a_part_of_itself(template):
    """Two large definitions in one step, and more in the steps after it: each gets a part that holds
    its first line, in a fair share of the step's and the live plan's room; none is dropped."""
    sess = _session_of(template, tokenize, textwrap)
    k_tok, k_tw = _position(sess, tokenize), _position(sess, textwrap)
    plan = sess.plan({2: "Refactor `_tokenize` and `TextWrapper`.", 3: "Explain generate_tokens.",
                      4: "Review the TextWrapper class, then `_tokenize` again."})
    assert not plan.dropped
    for step in (2, 4):
        got = planned(plan, step)
        assert covered(got, sess.tokens(k_tok, "def _tokenize(readline, encoding):")) == 1.0
        assert covered(got, sess.tokens(k_tw, "class TextWrapper:")) == 1.0
        assert size(got) <= 1024
    assert size({(s.start, s.end) for s in plan}) <= 2048


def test_a_method_named_by_a_dot_alone_is_a_method(template):
    """``.decode()`` is a method even where a module-level ``decode`` function exists (quopri's)."""
    sess = _session_of(template, json.decoder, quopri)
    plan = sess.plan({2: "Update `.decode()` so it logs a warning."})
    assert [(n.definition.owner, n.definition.name) for n in plan.needs] == [("JSONDecoder", "decode")]


def test_a_method_named_by_a_dot_alone_goes_to_the_class_the_steps_are_about(template):
    sess = _session_of(template, json.decoder, queue)
    steps = {2: "Read `Queue` first.", 3: "Then change `.get()` so that it logs.", 4: "Now `JSONDecoder`."}
    plan = sess.plan(steps)
    assert {n.definition.owner for n in plan.needs if n.step == 3} == {"Queue"}
    steps = {2: "Read `JSONDecoder` first.", 3: "Then make `.decode()` stricter.", 4: "Now `Queue`."}
    assert {n.definition.owner for n in sess.plan(steps).needs if n.step == 3} == {"JSONDecoder"}


BASE = """class TextWrapper:
    width = 70

    def wrap(self, text):
        return [text[:self.width]]
"""
DERIVED_FILE = """import base


class TextWrapper(base.TextWrapper):
    def extra_indent(self, indent):
        return indent
"""


@pytest.mark.parametrize("step", ["Call `TextWrapper.wrap`.", "Override `TextWrapper`.`wrap`."])
def test_a_base_of_the_same_name_in_another_file_is_found_through_the_import(template, step):
    """``class TextWrapper(base.TextWrapper)``: the base is base.py's class, not the subclass itself."""
    sess = Session(template, ("user", "Task."), *cat("pkg/base.py", BASE), *cat("pkg/ui.py", DERIVED_FILE))
    plan = sess.plan({2: step})
    wrap = "    def wrap(self, text):\n        return [text[:self.width]]"
    assert_found(sess, plan, 2, 2, wrap, tight=4)
    assert covered(planned(plan, 2), sess.tokens(4, "class TextWrapper(base.TextWrapper):")) == 1.0


def _rwbase(version):
    return f"""class NotebookWriter:
    def write(self, nb, fp):
        return fp.write(self.writes(nb, version={version}))
"""


NBJSON = """from .rwbase import NotebookWriter


class JSONWriter(NotebookWriter):
    def writes(self, nb, **kwargs):
        return str(nb)
"""


@pytest.mark.parametrize("step", ["Time `JSONWriter.write` on a cold cache.",
                                  "Why does `JSONWriter`.`write` take so long?"])
def test_a_relative_import_finds_the_base_in_the_importers_own_package(template, step):
    """Two files end with ``rwbase`` (``v4/`` and ``v3/``): ``from .rwbase import ...`` in ``v4/nbjson.py``
    is v4's, though v3's was printed later; a chain may be written as two pieces of code."""
    sess = Session(template, ("user", "Task."), *cat("nbformat/v4/rwbase.py", _rwbase(4)),
                   *cat("nbformat/v3/rwbase.py", _rwbase(3)), *cat("nbformat/v4/nbjson.py", NBJSON))
    plan = sess.plan({2: step})
    v4 = "    def write(self, nb, fp):\n        return fp.write(self.writes(nb, version=4))"
    assert_found(sess, plan, 2, 2, v4, tight=4)
    assert covered(planned(plan, 2), sess.tokens(4, "    def write(self, nb, fp):")) == 0.0  # not v3's
    assert covered(planned(plan, 2), sess.tokens(6, "class JSONWriter(NotebookWriter):")) == 1.0
