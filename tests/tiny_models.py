"""Tiny random-weight models built from configs: no download, real modeling code."""

import torch
import transformers as tf

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=65536)

YARN = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 16384}
LLAMA3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
LINEAR = {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}


def tiny_config(kind: str, **overrides):
    config = _tiny_config(kind)
    for name, value in overrides.items():
        setattr(config, name, value)
    return config


def _tiny_config(kind: str):
    if kind == "llama":
        return tf.LlamaConfig(**COMMON)
    if kind == "llama3":
        return tf.LlamaConfig(**COMMON, rope_parameters=LLAMA3)
    if kind == "linear":
        return tf.LlamaConfig(**COMMON, rope_parameters=LINEAR)
    if kind == "legacy_linear":  # pre-5 style keys, converted by the config class
        return tf.LlamaConfig(**COMMON, rope_theta=1e4, rope_scaling={"type": "linear", "factor": 2.0})
    if kind == "qwen2_yarn":
        return tf.Qwen2Config(**COMMON, rope_parameters=YARN)
    if kind == "qwen2":
        return tf.Qwen2Config(**COMMON, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if kind == "qwen3":
        return tf.Qwen3Config(**COMMON, head_dim=16)
    if kind == "mistral":
        return tf.MistralConfig(**COMMON, sliding_window=None)
    if kind == "phi":
        return tf.PhiConfig(**{k: v for k, v in COMMON.items()}, partial_rotary_factor=0.5)
    if kind == "gpt_neox":
        c = dict(COMMON)
        c.pop("num_key_value_heads")
        return tf.GPTNeoXConfig(**c, rotary_pct=0.25)
    if kind == "cohere":
        return tf.CohereConfig(**COMMON)
    if kind == "glm":
        return tf.GlmConfig(**COMMON, head_dim=16, pad_token_id=0)
    if kind == "gemma3":
        return tf.Gemma3TextConfig(**COMMON, head_dim=16, sliding_window=64, layer_types=["sliding_attention", "full_attention"])
    raise KeyError(kind)


def tiny_model(kind: str, dtype=torch.float32, seed: int = 0, vocab_size: int | None = None, **attn):
    torch.manual_seed(seed)
    config = tiny_config(kind, **({"vocab_size": vocab_size} if vocab_size else {}))
    model = tf.AutoModelForCausalLM.from_config(config, dtype=dtype, **attn)
    return model.eval()
