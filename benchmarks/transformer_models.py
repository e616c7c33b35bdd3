"""Language models for ``python -m effilayers.bench --tokens T``, built from
Hugging Face ``transformers`` configurations with random weights (no
download), for example::

    python -m effilayers.bench --model benchmarks.transformer_models:gpt2_small --tokens 512 --batch 2 \\
        --budget 0.35 --device cpu --clock cpu --threads 1

``use_cache`` is off: a training step keeps no key/value cache.
"""

from __future__ import annotations

from torch import nn


def gpt2(layers: int = 12, hidden: int = 768, heads: int = 12, positions: int = 1024, vocabulary: int = 50257,
         dropout: float = 0.1) -> nn.Module:
    """``GPT2LMHeadModel`` of the given size, random weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, n_positions=positions, vocab_size=vocabulary,
                        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, use_cache=False)
    return GPT2LMHeadModel(config)


def gpt2_small() -> nn.Module:
    """GPT-2 small: 12 layers, 768 wide, 12 heads (124M parameters)."""
    return gpt2()


def gpt2_tiny() -> nn.Module:
    """Four layers, 64 wide: the tests' size."""
    return gpt2(layers=4, hidden=64, heads=4, positions=128, vocabulary=512)
