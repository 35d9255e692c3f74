"""Transformer presets over ``torch.nn``: FFN, attention, blocks, embeddings and a small GPT.

Shape letters used throughout fitkit: ``B`` batch, ``T`` time/sequence, ``C`` channels or
embedding, ``V`` vocabulary, ``F`` features, ``H`` heads.

The layouts follow GPT-2 (Radford et al., 2019, "Language Models are Unsupervised Multitask
Learners") as re-implemented in Karpathy's nanoGPT (``model.py``); the constructor argument
names follow timm (``in_features``, ``act_layer``, ``norm_layer``, ``drop``).

Modules:
    :mod:`fitkit.layers.blocks`: :class:`FFN`, :class:`MultiHeadSelfAttention` and
    :class:`TransformerBlock`, the parts any transformer is made of.
    :mod:`fitkit.layers.gpt`: :class:`Embedding`, :class:`GPT` and
    :func:`param_groups_weight_decay`, the language-model presets built from them.

Every public name is importable from here, e.g. ``from fitkit.layers import GPT``.

Example:
    >>> import torch
    >>> from fitkit.layers import GPT
    >>> _ = torch.manual_seed(0)
    >>> gpt = GPT(vocab_size=65, block_size=8, n_layer=1, n_head=2, n_embd=16)
    >>> gpt(torch.zeros(2, 8, dtype=torch.long)).shape  # (B, T, V)
    torch.Size([2, 8, 65])
"""

from fitkit.layers.blocks import FFN, MultiHeadSelfAttention, TransformerBlock
from fitkit.layers.gpt import GPT, Embedding, param_groups_weight_decay

__all__ = ["FFN", "MultiHeadSelfAttention", "TransformerBlock", "Embedding", "GPT", "param_groups_weight_decay"]
