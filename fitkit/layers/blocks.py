"""Transformer building blocks: :class:`FFN`, :class:`MultiHeadSelfAttention`,
:class:`TransformerBlock`, and the argument checks the presets share.

Shape letters as in :mod:`fitkit.layers`: ``B`` batch, ``T`` time/sequence, ``C`` channels or
embedding, ``F`` features, ``H`` heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fitkit.checks import check_int, check_probability

__all__ = ["FFN", "MultiHeadSelfAttention", "TransformerBlock"]

# Factories rather than classes, so that "gelu_tanh" can carry its keyword argument.
_ACTIVATIONS = {
    "gelu": nn.GELU,
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
    "identity": nn.Identity,
    "relu": nn.ReLU,
    "sigmoid": nn.Sigmoid,
    "silu": nn.SiLU,
    "tanh": nn.Tanh,
}
_NORMS = {"layernorm": nn.LayerNorm, "rmsnorm": nn.RMSNorm}


def _lookup(arg: str, kind: str, value: object, table: dict, example: str):
    """Resolve a layer given by name (case-insensitive) or as an nn.Module class."""
    if isinstance(value, str):
        if value.lower() not in table:
            raise ValueError(
                f"Unknown {kind} {value!r} for `{arg}`. Valid names: "
                f"{', '.join(sorted(table))}. Or pass an nn.Module class, "
                f"e.g. {arg}=nn.{example}."
            )
        return table[value.lower()]
    if isinstance(value, type) and issubclass(value, nn.Module):
        return value
    raise TypeError(
        f"Expected `{arg}` to be a name or an nn.Module class. Received: "
        f"{arg}={value!r}. Pass e.g. {arg}={sorted(table)[0]!r}."
    )


def _make_norm(norm_layer: str | type[nn.Module], dim: int, bias: bool) -> nn.Module:
    cls = _lookup("norm_layer", "norm", norm_layer, _NORMS, "LayerNorm")
    # Only LayerNorm has a bias to drop; RMSNorm and custom classes get the width alone.
    return cls(dim, bias=bias) if issubclass(cls, nn.LayerNorm) else cls(dim)


class FFN(nn.Module):
    """Position-wise feed-forward network: Linear, activation, Linear, Dropout.

    The transformer MLP of Vaswani et al. (2017), "Attention Is All You Need", with the GELU
    of GPT-2 by default; timm's ``Mlp`` argument names, nanoGPT's single output dropout.

    Args:
        in_features: Input width ``F_in``.
        hidden_features: Width of the expansion; defaults to ``in_features``.
        out_features: Output width ``F_out``; defaults to ``in_features``.
        act_layer: Activation name (gelu, gelu_tanh, identity, relu, sigmoid, silu, tanh) or
            an ``nn.Module`` class built with no arguments.
        drop: Dropout probability on the output.
        bias: Whether both Linear layers have a bias.

    Raises:
        ValueError: Unknown activation name, a width below 1, or ``drop`` outside [0, 1).
        TypeError: ``act_layer`` is neither a name nor an ``nn.Module`` class.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> ffn = FFN(16, hidden_features=64, out_features=8, act_layer="relu")
        >>> ffn(torch.randn(2, 5, 16)).shape
        torch.Size([2, 5, 8])
    """

    def __init__(
        self,
        in_features: int,
        hidden_features: int | None = None,
        out_features: int | None = None,
        act_layer: str | type[nn.Module] = "gelu",
        drop: float = 0.0,
        bias: bool = True,
    ) -> None:
        super().__init__()
        hidden_features = in_features if hidden_features is None else hidden_features
        out_features = in_features if out_features is None else out_features
        for name, value in [
            ("in_features", in_features),
            ("hidden_features", hidden_features),
            ("out_features", out_features),
        ]:
            check_int(name, value, 1)
        check_probability("drop", drop)
        self.fc1 = nn.Linear(in_features, hidden_features, bias=bias)
        self.act = _lookup("act_layer", "activation", act_layer, _ACTIVATIONS, "GELU")()
        self.fc2 = nn.Linear(hidden_features, out_features, bias=bias)
        self.drop = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the network to the last dimension.

        Args:
            x: Input of shape ``(*, F_in)``.

        Returns:
            Output of shape ``(*, F_out)``.
        """
        return self.drop(self.fc2(self.act(self.fc1(x))))


class MultiHeadSelfAttention(nn.Module):
    """Multi-head self-attention with a fused QKV projection.

    Scaled dot-product attention of Vaswani et al. (2017) computed by
    ``F.scaled_dot_product_attention`` (flash / memory-efficient kernels where available), laid
    out as nanoGPT's ``CausalSelfAttention``: one Linear for Q, K and V, one output projection,
    dropout on the attention weights and on the output.

    Args:
        n_embd: Embedding width ``C``.
        n_head: Number of heads ``H``; must divide ``n_embd``.
        causal: If True, position ``t`` attends only to positions ``<= t``.
        dropout: Dropout probability on the attention weights and on the output (training only).
        bias: Whether the projections have a bias.

    Raises:
        ValueError: ``n_embd`` is not divisible by ``n_head``, or a bad width or dropout.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> attn = MultiHeadSelfAttention(n_embd=32, n_head=4, causal=True)
        >>> attn(torch.randn(2, 10, 32)).shape
        torch.Size([2, 10, 32])
    """

    def __init__(self, n_embd: int, n_head: int, causal: bool = False, dropout: float = 0.0, bias: bool = True) -> None:
        super().__init__()
        check_int("n_embd", n_embd, 1)
        check_int("n_head", n_head, 1)
        check_probability("dropout", dropout)
        if n_embd % n_head:
            hint = max(h for h in range(1, n_head + 1) if n_embd % h == 0)
            raise ValueError(
                f"Expected `n_embd` to be divisible by `n_head`. Received: "
                f"n_embd={n_embd}, n_head={n_head}. Pick a divisor of n_embd, "
                f"e.g. n_head={hint}."
            )
        self.n_embd, self.n_head, self.causal, self.dropout = n_embd, n_head, causal, dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.proj_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Attend over the sequence.

        Args:
            x: Input of shape ``(B, T, C)``.
            attn_mask: Optional mask broadcastable to ``(B, H, T, T)`` (query by key), with
                ``F.scaled_dot_product_attention`` semantics: a bool mask where True means
                "may attend", or a float mask added to the attention scores. Combined with the
                causal mask when ``causal=True``. Leave every query at least one key: a row
                with none gives NaN or zeros, depending on the torch version and kernel.

        Returns:
            Output of shape ``(B, T, C)``.

        Raises:
            ValueError: ``x`` is not 3-D or its last dimension is not ``n_embd``.
            TypeError: ``attn_mask`` is neither bool nor floating point.
        """
        if x.dim() != 3 or x.size(-1) != self.n_embd:
            raise ValueError(f"Expected `x` of shape (B, T, {self.n_embd}). Received: x of shape {tuple(x.shape)}.")
        B, T, C = x.shape
        q, k, v = (
            t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, H, T, C/H)
            for t in self.qkv(x).split(C, dim=-1)
        )
        is_causal = self.causal
        if attn_mask is not None:
            if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
                raise TypeError(
                    "Expected `attn_mask` of dtype bool (True = attend) or floating "
                    f"point (added to the scores). Received: {attn_mask.dtype}. "
                    "Convert it, e.g. attn_mask.bool()."
                )
            if attn_mask.is_floating_point():
                # SDPA wants a float mask in the query's dtype (bf16 under autocast).
                attn_mask = attn_mask.to(q.dtype)
            if self.causal:
                # SDPA refuses is_causal together with a mask, so fold causality into it.
                allowed = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
                if attn_mask.dtype == torch.bool:
                    attn_mask = attn_mask & allowed
                else:
                    attn_mask = attn_mask.masked_fill(~allowed, float("-inf"))
                is_causal = False
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal, dropout_p=self.dropout if self.training else 0.0
        )  # (B, H, T, C/H)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        return self.proj_drop(self.proj(y))


class TransformerBlock(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``.

    The pre-norm ordering of GPT-2 (Radford et al., 2019) and nanoGPT's ``Block``.

    Args:
        n_embd: Embedding width ``C``.
        n_head: Number of attention heads ``H``; must divide ``n_embd``.
        mlp_ratio: Hidden width of the MLP as a multiple of ``n_embd`` (4 in GPT-2).
        causal: Whether the attention is causal.
        dropout: Dropout probability in the attention and after the MLP.
        bias: Whether Linear layers and LayerNorms have a bias.
        act_layer: MLP activation, as in :class:`FFN`.
        norm_layer: "layernorm", "rmsnorm" (``nn.RMSNorm``, Zhang & Sennrich 2019) or an
            ``nn.Module`` class built as ``norm_layer(n_embd)``.

    Raises:
        ValueError: Unknown norm or activation name, or a bad width, ratio or dropout.
        TypeError: ``norm_layer`` or ``act_layer`` is neither a name nor a class.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> block = TransformerBlock(n_embd=32, n_head=4, causal=True, norm_layer="rmsnorm")
        >>> block(torch.randn(2, 10, 32)).shape
        torch.Size([2, 10, 32])
    """

    def __init__(
        self,
        n_embd: int,
        n_head: int,
        mlp_ratio: float = 4.0,
        causal: bool = False,
        dropout: float = 0.0,
        bias: bool = True,
        act_layer: str | type[nn.Module] = "gelu",
        norm_layer: str | type[nn.Module] = "layernorm",
    ) -> None:
        super().__init__()
        check_int("n_embd", n_embd, 1)
        if not isinstance(mlp_ratio, (int, float)) or isinstance(mlp_ratio, bool) or int(mlp_ratio * n_embd) < 1:
            raise ValueError(
                "Expected `mlp_ratio` > 0 with mlp_ratio * n_embd >= 1. "
                f"Received: mlp_ratio={mlp_ratio!r}, n_embd={n_embd}."
            )
        self.ln_1 = _make_norm(norm_layer, n_embd, bias)
        self.attn = MultiHeadSelfAttention(n_embd, n_head, causal=causal, dropout=dropout, bias=bias)
        self.ln_2 = _make_norm(norm_layer, n_embd, bias)
        self.mlp = FFN(n_embd, int(mlp_ratio * n_embd), act_layer=act_layer, drop=dropout, bias=bias)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Apply the block.

        Args:
            x: Input of shape ``(B, T, C)``.
            attn_mask: Optional attention mask, as in :meth:`MultiHeadSelfAttention.forward`.

        Returns:
            Output of shape ``(B, T, C)``.
        """
        x = x + self.attn(self.ln_1(x), attn_mask=attn_mask)
        return x + self.mlp(self.ln_2(x))
