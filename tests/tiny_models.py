"""Tiny random-weight models of each supported architecture, saved as Hugging Face folders."""

import torch

VOCAB = 320


def tiny_config(arch: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        initializer_range=0.15,
        eos_token_id=1,
        bos_token_id=2,
        pad_token_id=0,
    )
    if arch == "llama":  # GQA, biases everywhere, llama3 RoPE scaling, untied head
        return LlamaConfig(
            **common,
            num_key_value_heads=2,
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if arch == "mistral":  # MQA, sliding window larger than the model: plain attention
        return MistralConfig(
            **common,
            num_key_value_heads=1,
            tie_word_embeddings=False,
            sliding_window=None,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        )
    if arch == "qwen2":  # q/k/v bias, tied embeddings, yarn
        return Qwen2Config(
            **common,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if arch == "qwen3":  # q/k norm, head_dim that is not hidden / heads, linear RoPE scaling
        return Qwen3Config(
            **common,
            num_key_value_heads=2,
            head_dim=24,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        )
    raise ValueError(arch)


def save_tiny_model(arch: str, folder, seed: int = 0):
    """Build, randomise (norm weights too, so that a wrong norm shows) and save; returns the transformers model."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    return model


def save_tiny_chat_model(folder, seed: int = 0):
    """A tiny random Llama with the default model's tokenizer and chat template (vocabulary and all): for
    tests of the serving system, where the model's size only costs time."""
    from kvferry.tools.bench.random_model import save_random_model

    save_random_model(folder, "tiny", "float32", seed)
