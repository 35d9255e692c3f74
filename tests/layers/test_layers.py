"""Tests for fitkit.layers: shapes, causality, parity with naive attention, GPT recipe details."""

import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fitkit.layers import (
    FFN,
    GPT,
    Embedding,
    MultiHeadSelfAttention,
    TransformerBlock,
    param_groups_weight_decay,
)


def tiny_gpt(**kwargs):
    config = dict(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16)
    config.update(kwargs)
    return GPT(**config)


# --- shapes -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, in_shape, out_shape",
    [
        (dict(in_features=8), (3, 8), (3, 8)),
        (dict(in_features=8, hidden_features=32, out_features=4), (2, 5, 8), (2, 5, 4)),
        (dict(in_features=8, act_layer="relu", bias=False, drop=0.1), (2, 3, 7, 8), (2, 3, 7, 8)),
    ],
)
def test_ffn_shape(kwargs, in_shape, out_shape):
    torch.manual_seed(0)
    assert FFN(**kwargs)(torch.randn(in_shape)).shape == out_shape


@pytest.mark.parametrize("causal", [False, True])
def test_attention_and_block_shapes(causal):
    torch.manual_seed(0)
    x = torch.randn(2, 7, 16)
    assert MultiHeadSelfAttention(16, 4, causal=causal)(x).shape == (2, 7, 16)
    for norm in ["layernorm", "rmsnorm"]:
        block = TransformerBlock(16, 4, causal=causal, norm_layer=norm, dropout=0.1)
        assert block(x).shape == (2, 7, 16)


def test_embedding_and_gpt_shapes():
    torch.manual_seed(0)
    idx = torch.randint(0, 11, (3, 8))
    assert Embedding(11, 16, block_size=8)(idx).shape == (3, 8, 16)
    assert tiny_gpt()(idx).shape == (3, 8, 11)
    assert tiny_gpt()(idx[:, :3]).shape == (3, 3, 11)  # shorter than block_size is fine


# --- causality --------------------------------------------------------------------------------


def test_causal_attention_ignores_the_future():
    torch.manual_seed(0)
    attn = MultiHeadSelfAttention(16, 4, causal=True)
    x = torch.randn(2, 9, 16)
    t = 4
    x2 = x.clone()
    x2[:, t + 1 :] = torch.randn(2, 9 - t - 1, 16)
    y, y2 = attn(x), attn(x2)
    torch.testing.assert_close(y[:, : t + 1], y2[:, : t + 1])
    assert not torch.allclose(y[:, t + 1 :], y2[:, t + 1 :])


def test_gpt_is_causal():
    torch.manual_seed(0)
    gpt = tiny_gpt()
    idx = torch.randint(0, 11, (2, 8))
    for t in range(7):
        idx2 = idx.clone()
        idx2[:, t + 1 :] = (idx[:, t + 1 :] + 1) % 11  # change every later token
        logits, logits2 = gpt(idx), gpt(idx2)
        torch.testing.assert_close(logits[:, : t + 1], logits2[:, : t + 1])
        assert not torch.allclose(logits[:, t + 1 :], logits2[:, t + 1 :])


# --- parity with a hand-written attention -----------------------------------------------------


def naive_attention(attn, x, causal, attn_mask=None):
    """softmax(Q K^T / sqrt(d) + mask) V with the module's own weights."""
    B, T, C = x.shape
    H, d = attn.n_head, C // attn.n_head
    q, k, v = (x @ attn.qkv.weight.T + attn.qkv.bias).split(C, dim=-1)
    q, k, v = (t.reshape(B, T, H, d).transpose(1, 2) for t in (q, k, v))  # (B, H, T, d)
    scores = q @ k.transpose(-2, -1) / math.sqrt(d)  # (B, H, T, T)
    if causal:
        scores = scores.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    elif attn_mask is not None:
        scores = scores + attn_mask
    y = scores.softmax(dim=-1) @ v  # (B, H, T, d)
    y = y.transpose(1, 2).reshape(B, T, C)
    return y @ attn.proj.weight.T + attn.proj.bias


def _bool_mask(B, T):
    mask = torch.rand(B, 1, T, T) > 0.5
    return mask | torch.eye(T, dtype=torch.bool)  # every query keeps one key: no empty row


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
def test_attention_matches_naive_softmax(causal, mask_kind):
    torch.manual_seed(0)
    B, T, C = 2, 6, 12
    # float64 so that the comparison tests the math, not rounding.
    attn = MultiHeadSelfAttention(C, n_head=3, causal=causal).double()
    x = torch.randn(B, T, C, dtype=torch.float64)
    mask = {None: None, "bool": _bool_mask(B, T), "float": torch.randn(T, T, dtype=torch.float64)}[mask_kind]
    expected = naive_attention(attn, x, causal, mask)
    torch.testing.assert_close(attn(x, attn_mask=mask), expected)


def test_block_is_pre_norm_residual():
    torch.manual_seed(0)
    block = TransformerBlock(16, 4, causal=True)
    x = torch.randn(2, 5, 16)
    h = x + block.attn(block.ln_1(x))
    torch.testing.assert_close(block(x), h + block.mlp(block.ln_2(h)))


# --- construction options and errors ---------------------------------------------------------


def test_activation_and_norm_choices():
    assert isinstance(FFN(4, act_layer=nn.SiLU).act, nn.SiLU)
    assert isinstance(FFN(4, act_layer="GELU").act, nn.GELU)
    assert FFN(4, act_layer="gelu_tanh").act.approximate == "tanh"
    block = TransformerBlock(8, 2, bias=False)
    assert isinstance(block.ln_1, nn.LayerNorm) and block.ln_1.bias is None
    assert block.attn.qkv.bias is None and block.mlp.fc1.bias is None
    assert isinstance(TransformerBlock(8, 2, norm_layer="rmsnorm").ln_2, nn.RMSNorm)
    assert isinstance(TransformerBlock(8, 2, norm_layer=nn.RMSNorm).ln_1, nn.RMSNorm)
    assert TransformerBlock(8, 2, mlp_ratio=2.0).mlp.fc1.out_features == 16


def test_unknown_names_list_the_valid_ones():
    valid_acts = "gelu, gelu_tanh, identity, relu, sigmoid, silu, tanh"
    with pytest.raises(
        ValueError, match=re.escape(f"Unknown activation 'gelux' for `act_layer`. Valid names: {valid_acts}.")
    ):
        FFN(4, act_layer="gelux")
    with pytest.raises(
        ValueError, match=re.escape("Unknown norm 'batchnorm' for `norm_layer`. Valid names: layernorm, rmsnorm.")
    ):
        TransformerBlock(8, 2, norm_layer="batchnorm")
    with pytest.raises(TypeError, match="Expected `act_layer` to be a name or an nn.Module"):
        FFN(4, act_layer=42)
    with pytest.raises(TypeError, match="Expected `norm_layer` to be a name or an nn.Module"):
        TransformerBlock(8, 2, norm_layer=nn.LayerNorm(8))  # an instance, not a class


def test_bad_sizes_raise():
    with pytest.raises(ValueError, match=r"n_embd=10, n_head=4\. Pick a divisor .* n_head=2"):
        MultiHeadSelfAttention(10, 4)
    with pytest.raises(ValueError, match=r"Expected `drop` to be a probability in \[0, 1\)"):
        FFN(4, drop=1.0)
    with pytest.raises(TypeError, match="Expected `n_embd` to be an int"):
        MultiHeadSelfAttention(16.0, 4)
    with pytest.raises(ValueError, match="Expected `n_layer` >= 1. Received: n_layer=0"):
        tiny_gpt(n_layer=0)
    with pytest.raises(ValueError, match=r"Expected `x` of shape \(B, T, 16\)"):
        MultiHeadSelfAttention(16, 4)(torch.randn(2, 5, 8))
    with pytest.raises(TypeError, match="Expected `attn_mask` of dtype bool"):
        MultiHeadSelfAttention(16, 4)(torch.randn(1, 3, 16), attn_mask=torch.ones(3, 3).long())


def test_block_size_overflow_raises():
    gpt = tiny_gpt()
    with pytest.raises(ValueError, match=r"T <= block_size=8. Received: idx of shape \(2, 9\)"):
        gpt(torch.zeros(2, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="block_size=8"):
        Embedding(11, 16, block_size=8)(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(TypeError, match="integer token ids"):
        gpt(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"Expected `idx` of shape \(B, T\)"):
        gpt(torch.zeros(3, dtype=torch.long))


# --- GPT recipe -------------------------------------------------------------------------------


def test_gpt_parameter_count_matches_formula():
    V, T, L, C = 65, 64, 4, 128
    gpt = GPT(vocab_size=V, block_size=T, n_layer=L, n_head=4, n_embd=C, bias=False)
    # Per block: 2 LayerNorm weights (no bias) + attention (qkv 3*C*C, proj C*C)
    # + MLP (fc1 C*4C, fc2 4C*C). Then token emb V*C (tied to lm_head, counted once),
    # position emb T*C and the final LayerNorm weight C.
    per_block = 2 * C + 4 * C * C + 8 * C * C
    total = L * per_block + V * C + T * C + C
    assert gpt.num_parameters(non_embedding=False) == total == 804_096
    assert gpt.num_parameters() == total - T * C


def test_gpt_weight_tying_and_init():
    torch.manual_seed(0)
    L = 3
    gpt = GPT(vocab_size=50, block_size=16, n_layer=L, n_head=4, n_embd=128)
    assert gpt.lm_head.weight is gpt.embed.wte.weight
    assert all(torch.all(m.bias == 0) for m in gpt.modules() if isinstance(m, nn.Linear) and m.bias is not None)
    proj = torch.cat([torch.cat([b.attn.proj.weight.flatten(), b.mlp.fc2.weight.flatten()]) for b in gpt.blocks])
    assert proj.std().item() == pytest.approx(0.02 / math.sqrt(2 * L), rel=0.05)
    assert gpt.blocks[0].attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert gpt.embed.wpe.weight.std().item() == pytest.approx(0.02, rel=0.1)


def test_generate_shape_range_and_reproducibility():
    gpt = tiny_gpt()
    idx = torch.randint(0, 11, (3, 5), dtype=torch.int32)
    torch.manual_seed(1)
    out = gpt.generate(idx, max_new_tokens=12, temperature=0.8, top_k=5)
    assert out.shape == (3, 17) and out.dtype == torch.int64
    assert out.min() >= 0 and out.max() < 11
    assert torch.equal(out[:, :5], idx.long())
    torch.manual_seed(1)
    assert torch.equal(gpt.generate(idx, max_new_tokens=12, temperature=0.8, top_k=5), out)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(gpt.generate(idx, 6, generator=g1), gpt.generate(idx, 6, generator=g2))


def test_generate_top_k_1_is_greedy_and_crops_context():
    torch.manual_seed(0)
    gpt = tiny_gpt()  # block_size=8
    idx = torch.randint(0, 11, (2, 10))  # longer than block_size: only the last 8 are seen
    out = gpt.generate(idx, max_new_tokens=4, top_k=1)
    expected = idx
    for _ in range(4):
        nxt = gpt(expected[:, -8:])[:, -1].argmax(dim=-1, keepdim=True)
        expected = torch.cat([expected, nxt], dim=1)
    assert torch.equal(out, expected)


def test_generate_restores_training_flags_and_grad_mode():
    gpt = tiny_gpt(dropout=0.5)
    gpt.train()
    gpt.blocks[0].eval()  # a submodule the user froze stays frozen
    before = {name: m.training for name, m in gpt.named_modules()}
    gpt.generate(torch.zeros(1, 1, dtype=torch.long), max_new_tokens=3)
    assert {name: m.training for name, m in gpt.named_modules()} == before
    assert torch.is_grad_enabled()


def test_generate_rejects_bad_arguments():
    gpt = tiny_gpt()
    idx = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="Expected `temperature` > 0"):
        gpt.generate(idx, 3, temperature=0.0)
    with pytest.raises(ValueError, match="Expected `top_k` to be None or an int >= 1"):
        gpt.generate(idx, 3, top_k=0)
    with pytest.raises(ValueError, match="Expected `max_new_tokens`"):
        gpt.generate(idx, -1)
    assert gpt.generate(idx, 0).shape == (1, 2)


def test_param_groups_weight_decay():
    gpt = tiny_gpt()
    gpt.embed.wpe.weight.requires_grad_(False)  # frozen parameters are left out
    decay, no_decay = param_groups_weight_decay(gpt, weight_decay=0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"])
    assert all(p.dim() < 2 for p in no_decay["params"])
    grouped = decay["params"] + no_decay["params"]
    trainable = [p for p in gpt.parameters() if p.requires_grad]
    assert len(grouped) == len({id(p) for p in grouped}) == len(trainable)
    torch.optim.AdamW([decay, no_decay], lr=1e-3)
    with pytest.raises(ValueError, match="Expected `weight_decay` to be a number >= 0"):
        param_groups_weight_decay(gpt, -0.1)


def test_gpt_learns_a_repeated_sequence():
    torch.manual_seed(0)
    gpt = tiny_gpt()
    idx = torch.arange(9).remainder(11).unsqueeze(0).repeat(4, 1)  # (4, 9)
    x, y = idx[:, :-1], idx[:, 1:]
    opt = torch.optim.AdamW(param_groups_weight_decay(gpt, 0.1), lr=1e-2)
    losses = []
    for _ in range(30):
        loss = F.cross_entropy(gpt(x).flatten(0, 1), y.flatten())  # (B*T, V) vs (B*T,)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.1 * losses[0]
