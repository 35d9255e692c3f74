"""Tests for fitkit.text: the character tokenizer and the next-token dataset."""

import pytest
import torch
from torch.utils.data import DataLoader

from fitkit.examples.shakespeare import default_text_path
from fitkit.text import CharTokenizer, NextTokenDataset

SHAKESPEARE = default_text_path()  # the copy inside the package


def test_tokenizer_round_trips_tinyshakespeare():
    text = SHAKESPEARE.read_text(encoding="utf-8")
    tok = CharTokenizer.from_text(text)
    assert tok.vocab_size == 65  # the figure nanoGPT's prepare.py prints for this file
    ids = tok.encode(text)
    assert ids.shape == (len(text),) and ids.dtype == torch.int64
    assert ids.min() == 0 and ids.max() == tok.vocab_size - 1
    assert tok.decode(ids) == text


def test_tokenizer_vocabulary_is_sorted_characters():
    tok = CharTokenizer("hello world")
    assert tok.chars == [" ", "d", "e", "h", "l", "o", "r", "w"]
    assert tok.vocab_size == 8
    assert tok.encode("lower").tolist() == [4, 5, 7, 2, 6]
    assert tok.encode("").shape == (0,)
    assert tok.decode([3, 2, 4, 4, 5]) == "hello"
    assert tok.decode(torch.tensor([7, 5], dtype=torch.int32)) == "wo"
    assert tok.decode([]) == ""
    assert repr(tok) == "CharTokenizer(vocab_size=8)"


def test_tokenizer_errors():
    tok = CharTokenizer("abc")
    with pytest.raises(ValueError, match=r"Unknown character 'Z' \(U\+005A\) at position 2"):
        tok.encode("abZc")
    with pytest.raises(ValueError, match=r"Expected token ids in \[0, 3\). Received id 3"):
        tok.decode([0, 3])
    with pytest.raises(ValueError, match="Received id -1"):
        tok.decode(torch.tensor([-1, 0]))
    with pytest.raises(ValueError, match=r"Expected `ids` of shape \(T,\)"):
        tok.decode(torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(TypeError, match="integer token ids"):
        tok.decode(torch.tensor([0.0, 1.0]))
    with pytest.raises(TypeError, match="Expected `text` to be a str"):
        tok.encode(b"abc")
    with pytest.raises(TypeError, match="Expected `text` to be a str"):
        CharTokenizer(["a", "b"])
    with pytest.raises(ValueError, match="non-empty `text`"):
        CharTokenizer("")


def test_next_token_dataset_items_and_length():
    tokens = torch.arange(100, 120)
    ds = NextTokenDataset(tokens, block_size=5)
    assert len(ds) == 15
    for i in range(len(ds)):
        x, y = ds[i]
        assert x.tolist() == list(range(100 + i, 105 + i))
        assert y.tolist() == list(range(101 + i, 106 + i))
    last_x, last_y = ds[-1]
    assert last_x.tolist() == list(range(114, 119)) and last_y[-1] == 119
    with pytest.raises(IndexError, match="out of range"):
        ds[15]
    with pytest.raises(IndexError, match="out of range"):
        ds[-16]
    assert len(list(iter(ds))) == 15  # the legacy iteration protocol stops at IndexError


def test_next_token_dataset_batches_through_dataloader():
    torch.manual_seed(0)
    ds = NextTokenDataset(torch.randint(0, 65, (50,), dtype=torch.int32), block_size=8)
    x, y = next(iter(DataLoader(ds, batch_size=4, shuffle=True)))
    assert x.shape == y.shape == (4, 8) and x.dtype == y.dtype == torch.int64
    torch.testing.assert_close(x[:, 1:], y[:, :-1])


def test_next_token_dataset_smallest_input():
    ds = NextTokenDataset(torch.tensor([1, 2, 3]), block_size=2)
    assert len(ds) == 1
    assert [t.tolist() for t in ds[0]] == [[1, 2], [2, 3]]


def test_next_token_dataset_errors():
    with pytest.raises(
        ValueError,
        match=r"Expected at least block_size \+ 1 = 6 tokens. "
        "Received: 5 tokens",
    ):
        NextTokenDataset(torch.arange(5), block_size=5)
    with pytest.raises(ValueError, match=r"Expected `tokens` of shape \(N,\)"):
        NextTokenDataset(torch.zeros(2, 10, dtype=torch.long), block_size=3)
    with pytest.raises(TypeError, match="integer token ids"):
        NextTokenDataset(torch.zeros(10), block_size=3)
    with pytest.raises(TypeError, match="Expected `tokens` to be a torch.Tensor"):
        NextTokenDataset(list(range(10)), block_size=3)
    with pytest.raises(ValueError, match="Expected `block_size` >= 1"):
        NextTokenDataset(torch.arange(10), block_size=0)
    with pytest.raises(TypeError, match="Expected `block_size` to be an int"):
        NextTokenDataset(torch.arange(10), block_size=2.0)
