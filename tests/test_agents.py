"""PACEModel inside a real smolagents agent loop (tiny random llama with the SmolLM2 chat template)."""

import pytest
import torch
import transformers as tf

smolagents = pytest.importorskip("smolagents")

from smolagents import CodeAgent, tool  # noqa: E402
from smolagents.models import ChatMessage, MessageRole, Model, remove_content_after_stop_sequences  # noqa: E402
from tiny_models import tiny_model  # noqa: E402

from pace_bench.models import load_tokenizer  # noqa: E402
from pace_hf.agents import PACEModel, flatten, plan_items  # noqa: E402


@tool
def ledger_balance(owner: str) -> str:
    """Returns the balance of an owner's ledger.

    Args:
        owner: the ledger's owner
    """
    return {"ada": "41", "bob": "7"}.get(owner.lower(), "unknown owner")


@pytest.fixture(scope="module")
def tiny():
    tokenizer = load_tokenizer("smollm2-135m")
    return tiny_model("llama", vocab_size=len(tokenizer)), tokenizer


class DynamicCacheModel(Model):
    """The reference: every call renders the whole conversation with the tokenizer's chat template and
    prefills it into a fresh DynamicCache."""

    def __init__(self, model, tokenizer, max_new_tokens):
        super().__init__(model_id="reference")
        self.model, self.tokenizer, self.max_new_tokens = model, tokenizer, max_new_tokens

    def generate(self, messages, stop_sequences=None, **kwargs):
        system, flat = flatten(messages)
        chat = [{"role": "system", "content": system}] + [{"role": r, "content": c} for r, c in flat]
        text = self.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        ids = torch.tensor([self.tokenizer(text, add_special_tokens=False)["input_ids"]])
        stop = sorted({self.tokenizer.convert_tokens_to_ids("<|im_end|>"), self.tokenizer.eos_token_id})
        extra = {"stop_strings": stop_sequences, "tokenizer": self.tokenizer} if stop_sequences else {}
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), cache=tf.DynamicCache(config=self.model.config),
                                      max_new_tokens=self.max_new_tokens, do_sample=False, eos_token_id=stop,
                                      pad_token_id=stop[0], **extra)
        reply = self.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        return ChatMessage(role=MessageRole.ASSISTANT, content=remove_content_after_stop_sequences(reply, stop_sequences))


def record(model):
    """Wrap ``model.generate`` to keep every call's messages, reply and accounting."""
    calls, inner = [], model.generate

    def generate(messages, stop_sequences=None, **kwargs):
        reply = inner(messages, stop_sequences=stop_sequences, **kwargs)
        calls.append({"flat": flatten(messages), "stops": stop_sequences, "reply": reply.content,
                      "raw": (reply.raw or {}).get("text"), "last": dict(getattr(model, "last", {}))})
        return reply

    model.generate = generate
    return calls


def rendered_len(tokenizer, system, flat):
    chat = [{"role": "system", "content": system}] + [{"role": r, "content": c} for r, c in flat]
    return len(tokenizer(tokenizer.apply_chat_template(chat, tokenize=False), add_special_tokens=False)["input_ids"])


def test_a_code_agent_prefills_only_what_is_new_and_answers_like_dynamic_cache(tiny):
    model, tokenizer = tiny
    runs = {}
    for name, llm in (("pace", PACEModel(model, tokenizer, budget=4096, limit=16384, max_new_tokens=12)),
                      ("full", DynamicCacheModel(model, tokenizer, 12))):
        calls = record(llm)
        agent = CodeAgent(tools=[ledger_balance], model=llm, max_steps=3, planning_interval=2, verbosity_level=0)
        agent.run("What is the balance of ada's ledger? Use ledger_balance.")
        runs[name] = (calls, llm)
    pace, full = runs["pace"][0], runs["full"][0]
    assert [c["reply"] for c in pace] == [c["reply"] for c in full]  # nothing was evicted
    assert len(pace) >= 5  # plan, act, act, plan, act (and the final answer)
    llm = runs["pace"][1]
    assert llm.session.cache.resident_count() == llm.session.cache.get_seq_length()  # indeed nothing evicted
    main = [c for c in pace if not c["last"].get("planning")]
    for prev, call in zip(main, main[1:]):
        system, flat = call["flat"]
        if system != prev["flat"][0]:  # the final-answer call: another system prompt, a new session
            assert call["last"]["rebuilt"] and call["last"]["reused_tokens"] == 0
            continue
        held = prev["flat"][1] + [("assistant", prev["raw"])]
        keep = next((i for i, (a, b) in enumerate(zip(held, flat)) if a != b), min(len(held), len(flat)))
        seen = prev["last"]["prompt_tokens"] + prev["last"]["output_tokens"] - 1
        expected = seen if keep == len(held) else rendered_len(tokenizer, system, flat[:keep])
        assert call["last"]["kept_messages"] == keep
        assert call["last"]["reused_tokens"] == expected > rendered_len(tokenizer, system, [])
        assert call["last"]["prefilled_tokens"] == call["last"]["prompt_tokens"] - expected
        assert call["last"]["prefilled_tokens"] < call["last"]["prompt_tokens"] // 2  # the history is not re-sent
    # the planning steps became the planner's step descriptions
    assert any(c["last"].get("planning") for c in pace)
    assert llm.steps and llm.session.planner.steps == llm.steps


def test_a_real_model_calls_its_tool_through_pace_and_answers_with_its_result():
    """The bundled Qwen2.5-Coder-0.5B in a CodeAgent: the code it writes calls the tool (the random
    tiny model above never does), the tool's output reaches the agent, and the final answer is it."""
    from pace_bench.models import load_model

    model, tokenizer = load_model("qwen2.5-coder-0.5b", dtype=torch.float32)
    called = []

    @tool
    def ledger_balance(owner: str) -> str:
        """Returns the balance of an owner's ledger.

        Args:
            owner: the ledger's owner
        """
        called.append(owner)
        return {"ada": "41", "bob": "7"}.get(owner.lower(), "unknown owner")

    llm = PACEModel(model, tokenizer, budget=4096, limit=16384, max_new_tokens=96)
    agent = CodeAgent(tools=[ledger_balance], model=llm, max_steps=2, verbosity_level=0)
    out = agent.run('Run this code: balance = ledger_balance(owner="ada"); final_answer(balance)')
    assert called == ["ada"]
    assert str(out) == "41"
    assert llm.last["prompt_tokens"] > 1000 and llm.last["output_tokens"] > 0  # the whole system prompt went through PACE
    assert llm.session.cache.get_seq_length() == llm.last["prompt_tokens"] + llm.last["output_tokens"] - 1


def test_edited_history_is_rewound_or_rebuilt_never_reused(tiny):
    model, tokenizer = tiny
    ref = DynamicCacheModel(model, tokenizer, 16)
    sys_msg = {"role": "system", "content": [{"type": "text", "text": "You write Python."}]}

    def user(text):
        return {"role": "user", "content": [{"type": "text", "text": text}]}

    def assistant(text):
        return {"role": "assistant", "content": [{"type": "text", "text": text}]}

    first = [sys_msg, user("Define class Ledger with owner and balance."), assistant("class Ledger: ..."),
             user("Now add a deposit method.")]
    edited = first[:1] + [user("Define class Account with id and total.")] + first[2:]
    llm = PACEModel(model, tokenizer, budget=4096, limit=16384, max_new_tokens=16)
    llm.generate(first)
    out = llm.generate(edited)
    assert llm.last["rewound"] and not llm.last["rebuilt"] and llm.last["kept_messages"] == 0
    assert llm.last["reused_tokens"] == rendered_len(tokenizer, "You write Python.", [])
    assert out.content == ref.generate(edited).content
    # under eviction the tokens past the edit are gone from the cache: the session is started over
    small = PACEModel(model, tokenizer, budget=48, limit=160, recent=8, chunk=32, max_new_tokens=16)
    small.generate(first)
    out = small.generate(edited)
    assert small.last["rebuilt"] and small.last["reused_tokens"] == 0
    fresh = PACEModel(model, tokenizer, budget=48, limit=160, recent=8, chunk=32, max_new_tokens=16)
    assert out.content == fresh.generate(edited).content


@pytest.mark.parametrize("retrieval", [True, False])
def test_with_a_store_each_user_turn_brings_back_the_evicted_pages_it_asks_about(tiny, retrieval):
    from pace_hf.tiers import HostTier, TieredStore

    model, tokenizer = tiny
    filler = "The grass is green. The sky is blue. The sun is yellow. " * 8

    def user(text):
        return {"role": "user", "content": [{"type": "text", "text": text}]}

    def assistant(text):
        return {"role": "assistant", "content": [{"type": "text", "text": text}]}

    read = [user(filler + "The courier's password is zebrafinch seven three. " + filler), assistant("Noted."),
            user(filler * 2)]
    llm = PACEModel(model, tokenizer, budget=64, limit=256, recent=8, chunk=64, max_new_tokens=2,
                    store=TieredStore([HostTier()]), session_id="agent", retrieval=retrieval)
    reply = llm.generate(read)  # read and evicted: the fact is in the store
    llm.generate(read + [assistant(reply.content), user("What is the courier's zebrafinch password?")])
    restored = llm.session.cache.tier_stats.get("retrieval_pages_restored", 0)
    assert (restored >= 1) is retrieval


def test_stop_sequences_are_honoured(tiny):
    model, tokenizer = tiny
    messages = [{"role": "user", "content": [{"type": "text", "text": "Say something long."}]}]
    llm = PACEModel(model, tokenizer, max_new_tokens=32)
    whole = llm.generate(messages).content
    stop = whole[len(whole) // 2:len(whole) // 2 + 4]
    assert stop.strip()
    cut = llm.generate(messages, stop_sequences=[stop])
    assert cut.content == whole[:whole.index(stop)]
    assert cut.token_usage.output_tokens < 32  # generation stopped there, it was not just trimmed


def test_plan_items():
    assert plan_items("1. read the ledger\n2. call settle(record)\n") == ["read the ledger", "call settle(record)"]
    assert plan_items("- a\n- b") == ["a", "b"]
    assert plan_items("just do it") == ["just do it"]
