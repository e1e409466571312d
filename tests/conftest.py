"""Shared fixtures: tiny random decoders that need no download."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from sdbench.models.runner import ModelRunner

VOCAB = 96


def tiny_model(seed: int = 0, arch: str = "llama", layers: int = 2, hidden: int = 64, heads: int = 4, kv: int = 2):
    torch.manual_seed(seed)
    cls_cfg, cls_model = (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    # a wide init makes logits peaked, so greedy choices are far from ties and robust to summation order
    cfg = cls_cfg(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv, initializer_range=0.3,
                  max_position_embeddings=1024, tie_word_embeddings=False)
    return cls_model(cfg).eval()


@pytest.fixture(scope="session")
def target():
    return ModelRunner(tiny_model(0), "tiny-target")


@pytest.fixture(scope="session")
def small_draft():
    return ModelRunner(tiny_model(1, layers=1, hidden=32, heads=2, kv=1), "tiny-draft")


@pytest.fixture(scope="session")
def prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (6, 11, 3, 8)]
