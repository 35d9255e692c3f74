"""Language-model presets: :class:`Embedding`, :class:`GPT` and the optimizer grouping
:func:`param_groups_weight_decay`.

Shape letters as in :mod:`fitkit.layers`: ``B`` batch, ``T`` time/sequence, ``C`` embedding,
``V`` vocabulary, ``H`` heads.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fitkit.checks import check_int, check_probability
from fitkit.layers.blocks import TransformerBlock
from fitkit.modes import modes

__all__ = ["Embedding", "GPT", "param_groups_weight_decay"]


def _check_idx(idx: torch.Tensor) -> None:
    if idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
        raise TypeError(
            f"Expected `idx` to hold integer token ids. Received dtype {idx.dtype}. Convert it, e.g. idx.long()."
        )
    if idx.dim() != 2 or idx.size(1) < 1:
        raise ValueError(
            f"Expected `idx` of shape (B, T) with T >= 1. Received: shape "
            f"{tuple(idx.shape)}. Add a batch dimension, e.g. idx[None]."
        )


class Embedding(nn.Module):
    """Token embedding plus learned absolute position embedding, then dropout (GPT-2).

    Args:
        vocab_size: Vocabulary size ``V``.
        n_embd: Embedding width ``C``.
        block_size: Longest sequence ``T`` that has a position embedding.
        dropout: Dropout probability on the sum.

    Raises:
        ValueError: A size below 1 or ``dropout`` outside [0, 1).

    Example:
        >>> _ = torch.manual_seed(0)
        >>> emb = Embedding(vocab_size=65, n_embd=32, block_size=8)
        >>> emb(torch.randint(0, 65, (2, 8))).shape
        torch.Size([2, 8, 32])
    """

    def __init__(self, vocab_size: int, n_embd: int, block_size: int, dropout: float = 0.0) -> None:
        super().__init__()
        for name, value in [("vocab_size", vocab_size), ("n_embd", n_embd), ("block_size", block_size)]:
            check_int(name, value, 1)
        check_probability("dropout", dropout)
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Embed token ids.

        Args:
            idx: Token ids of shape ``(B, T)``, integer dtype, ``T <= block_size``.

        Returns:
            Embeddings of shape ``(B, T, C)``.

        Raises:
            TypeError: ``idx`` is not an integer tensor.
            ValueError: ``idx`` is not 2-D, ``T == 0`` or ``T > block_size``.
        """
        _check_idx(idx)
        T = idx.size(1)
        if T > self.block_size:
            raise ValueError(
                f"Expected a sequence length T <= block_size={self.block_size}. "
                f"Received: idx of shape {tuple(idx.shape)}. Crop the input, e.g. "
                f"idx[:, -{self.block_size}:], or use a larger block_size."
            )
        pos = torch.arange(T, device=idx.device)  # (T,)
        return self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)


class GPT(nn.Module):
    """Decoder-only language model: GPT-2 (Radford et al., 2019) in nanoGPT's layout.

    :class:`Embedding`, ``n_layer`` causal pre-norm blocks (:class:`TransformerBlock`), a final
    LayerNorm and a bias-free ``lm_head`` whose weight is tied to the token embedding (Press &
    Wolf, 2017). Initialisation as in nanoGPT: weights normal(0, 0.02), biases zero, and the two
    residual projections of each block (``attn.proj``, ``mlp.fc2``) normal(0,
    0.02 / sqrt(2 * n_layer)) (GPT-2 paper, section 2.3).

    The forward pass returns logits only; ``compile(loss="cross_entropy")`` takes them as
    ``(B, T, V)`` with ``(B, T)`` targets (the mean over all ``B*T`` positions).
    ``python -m fitkit.examples.shakespeare`` trains it with nanoGPT's recipe.

    Args:
        vocab_size: Vocabulary size ``V``.
        block_size: Context length: the longest ``T`` the model accepts.
        n_layer: Number of transformer blocks.
        n_head: Attention heads ``H`` per block; must divide ``n_embd``.
        n_embd: Embedding width ``C``.
        dropout: Dropout probability everywhere (nanoGPT uses 0.0 for GPT-2 pre-training and
            0.2 in its Shakespeare-char recipe).
        bias: Whether Linear layers and LayerNorms have biases (False is slightly better
            and faster, as noted in nanoGPT).

    Raises:
        ValueError: Bad sizes or dropout, e.g. ``n_embd`` not divisible by ``n_head``.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> gpt = GPT(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=32)
        >>> idx = torch.randint(0, 65, (2, 16))
        >>> gpt(idx).shape
        torch.Size([2, 16, 65])
        >>> gpt.generate(idx[:, :4], max_new_tokens=20, top_k=10).shape
        torch.Size([2, 24])
        >>> gpt.num_parameters()
        27552
    """

    def __init__(
        self,
        vocab_size: int,
        block_size: int,
        n_layer: int,
        n_head: int,
        n_embd: int,
        dropout: float = 0.0,
        bias: bool = True,
    ) -> None:
        super().__init__()
        check_int("n_layer", n_layer, 1)
        self.vocab_size, self.block_size, self.n_layer = vocab_size, block_size, n_layer
        self.embed = Embedding(vocab_size, n_embd, block_size, dropout=dropout)
        self.blocks = nn.ModuleList(
            TransformerBlock(n_embd, n_head, causal=True, dropout=dropout, bias=bias) for _ in range(n_layer)
        )
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        # Weight tying saves V*C parameters and helps small models (Press & Wolf, 2017).
        self.embed.wte.weight = self.lm_head.weight
        self.init_weights()

    def init_weights(self) -> None:
        """GPT-2's initialisation, in place: N(0, 0.02) weights, zero biases, the residual
        projections at ``0.02 / sqrt(2 * n_layer)``, LayerNorms at ones and zeros. Run by
        ``__init__``, and by fitkit after building the model on the meta device
        (:mod:`fitkit.distributed.meta`)."""
        for module in self.modules():
            if isinstance(module, nn.LayerNorm):
                module.reset_parameters()  # ones and zeros: no random numbers drawn
        self.apply(self._init_weights)
        # Each block adds two residual branches; scaling keeps the residual stream's variance
        # from growing with depth (GPT-2 paper, section 2.3).
        residual_std = 0.02 / math.sqrt(2 * self.n_layer)
        block: Any
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.fc2.weight, mean=0.0, std=residual_std)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Compute next-token logits.

        Args:
            idx: Token ids of shape ``(B, T)``, integer dtype, ``T <= block_size``.

        Returns:
            Logits of shape ``(B, T, V)``; position ``t`` scores token ``t + 1``.

        Raises:
            TypeError: ``idx`` is not an integer tensor.
            ValueError: ``idx`` is not 2-D, ``T == 0`` or ``T > block_size``.
        """
        x = self.embed(idx)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, V)

    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        *,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Sample tokens autoregressively (nanoGPT's ``generate``).

        Runs in eval mode without autograd and restores every submodule's ``training`` flag
        afterwards. The context is cropped to the last ``block_size`` tokens at each step. Each
        step recomputes the whole context (no KV cache): cost grows as ``max_new_tokens * T``.

        Args:
            idx: Prompt token ids of shape ``(B, T)``, integer dtype, ``T >= 1``.
            max_new_tokens: Number of tokens ``n`` to append.
            temperature: Divides the logits; below 1 sharpens, above 1 flattens.
            top_k: If given, sample only among the ``top_k`` most likely tokens
                (``top_k=1`` is greedy decoding).
            generator: Optional random generator for ``torch.multinomial``, on the model's
                device; the global RNG otherwise.

        Returns:
            Token ids of shape ``(B, T + n)``, int64, on the model's device: the prompt
            followed by the samples.

        Raises:
            TypeError: ``idx`` is not an integer tensor.
            ValueError: Bad ``idx`` shape, ``max_new_tokens < 0``, ``temperature <= 0`` or
                ``top_k < 1``.
        """
        _check_idx(idx)
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(
                f"Expected `max_new_tokens` to be an int >= 0. Received: max_new_tokens={max_new_tokens!r}."
            )
        if not temperature > 0:
            raise ValueError(
                f"Expected `temperature` > 0. Received: temperature={temperature}. For greedy decoding use top_k=1."
            )
        if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
            raise ValueError(f"Expected `top_k` to be None or an int >= 1. Received: top_k={top_k!r}.")
        idx = idx.to(self.lm_head.weight.device, torch.long)
        with modes(self, training=False, grad=False):  # flags and grad mode come back as they were
            for _ in range(max_new_tokens):
                logits = self(idx[:, -self.block_size :])  # (B, T', V)
                logits = logits[:, -1, :] / temperature  # (B, V)
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = F.softmax(logits, dim=-1)  # (B, V)
                idx_next = torch.multinomial(probs, 1, generator=generator)  # (B, 1)
                idx = torch.cat((idx, idx_next), dim=1)
        return idx

    def num_parameters(self, non_embedding: bool = True) -> int:
        """Count parameters (nanoGPT's ``get_num_params``).

        Args:
            non_embedding: If True, leave out the position embeddings. The token embeddings
                stay counted: they are tied to ``lm_head`` and act as its weight.

        Returns:
            The number of parameters; tied weights count once.
        """
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.embed.wpe.weight.numel()
        return n


def param_groups_weight_decay(module: nn.Module, weight_decay: float) -> list[dict]:
    """Split trainable parameters into a decayed and a non-decayed optimizer group.

    nanoGPT's ``configure_optimizers`` rule: parameters with ``dim >= 2`` (matmul weights and
    embeddings) get ``weight_decay``; biases and norm weights (``dim < 2``) get none. Frozen
    parameters (``requires_grad=False``) are left out; tied parameters appear once.

    Args:
        module: The module whose parameters to group.
        weight_decay: Decay for the first group (e.g. 0.1 in nanoGPT's GPT-2 recipe).

    Returns:
        ``[{"params": decay, "weight_decay": weight_decay}, {"params": no_decay,
        "weight_decay": 0.0}]``, ready for any ``torch.optim`` optimizer; either list may be
        empty.

    Raises:
        ValueError: ``weight_decay`` is negative or not a number.

    Example:
        >>> gpt = GPT(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=32)
        >>> groups = param_groups_weight_decay(gpt, weight_decay=0.1)
        >>> [(len(g["params"]), g["weight_decay"]) for g in groups]
        [(10, 0.1), (18, 0.0)]

        Then, as in nanoGPT: ``torch.optim.AdamW(groups, lr=6e-4, betas=(0.9, 0.95))``.
    """
    if not isinstance(weight_decay, (int, float)) or isinstance(weight_decay, bool) or not weight_decay >= 0:
        raise ValueError(f"Expected `weight_decay` to be a number >= 0. Received: weight_decay={weight_decay!r}.")
    params = [p for p in module.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
