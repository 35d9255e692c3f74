"""Character-level text utilities for language-model recipes.

Shape letters used throughout fitkit: ``B`` batch, ``T`` time/sequence, ``V`` vocabulary.

The tokenizer and the windowed dataset follow the Shakespeare-char recipe of Karpathy's nanoGPT
(``data/shakespeare_char/prepare.py``): the vocabulary is the sorted set of characters of the
training text, and a training example is a window of ``block_size`` tokens paired with the same
window shifted by one.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
from torch.utils.data import Dataset

__all__ = ["CharTokenizer", "NextTokenDataset"]


class CharTokenizer:
    """Maps each character of a fixed vocabulary to an integer id and back.

    The vocabulary is the sorted set of characters of ``text``, so ids are stable for a given
    text (nanoGPT's Shakespeare-char ``stoi`` / ``itos``).

    Args:
        text: The text whose characters form the vocabulary (usually the whole corpus).

    Raises:
        TypeError: ``text`` is not a ``str``.
        ValueError: ``text`` is empty.

    Example:
        >>> tok = CharTokenizer("hello world")
        >>> tok.vocab_size
        8
        >>> ids = tok.encode("hello")
        >>> ids
        tensor([3, 2, 4, 4, 5])
        >>> tok.decode(ids)
        'hello'
    """

    def __init__(self, text: str) -> None:
        if not isinstance(text, str):
            raise TypeError(
                f"Expected `text` to be a str. Received: {type(text).__name__}. "
                "Read the file first, e.g. Path(path).read_text()."
            )
        if not text:
            raise ValueError("Expected a non-empty `text` to build the vocabulary from. Received: ''.")
        self.chars: list[str] = sorted(set(text))
        self.stoi: dict[str, int] = {c: i for i, c in enumerate(self.chars)}

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        """Build a tokenizer whose vocabulary is the characters of ``text``.

        Args:
            text: The text whose characters form the vocabulary.

        Returns:
            The tokenizer; same as ``CharTokenizer(text)``.

        Example:
            >>> CharTokenizer.from_text("abca")
            CharTokenizer(vocab_size=3)
        """
        return cls(text)

    @property
    def vocab_size(self) -> int:
        """Number of distinct characters ``V``; ids are in ``[0, V)``."""
        return len(self.chars)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size})"

    def encode(self, text: str) -> torch.Tensor:
        """Convert a string to token ids.

        Args:
            text: The string to encode; every character must be in the vocabulary.

        Returns:
            Token ids of shape ``(T,)``, int64, where ``T = len(text)``.

        Raises:
            TypeError: ``text`` is not a ``str``.
            ValueError: ``text`` holds a character outside the vocabulary.

        Example:
            >>> CharTokenizer("abc").encode("cab")
            tensor([2, 0, 1])
        """
        if not isinstance(text, str):
            raise TypeError(f"Expected `text` to be a str. Received: {type(text).__name__}.")
        try:
            ids = [self.stoi[c] for c in text]
        except KeyError:
            # The slow scan only runs on the error path, to name the first offender.
            pos, char = next((i, c) for i, c in enumerate(text) if c not in self.stoi)
            raise ValueError(
                f"Unknown character {char!r} (U+{ord(char):04X}) at position {pos} of `text`; "
                f"the vocabulary has {self.vocab_size} characters. Build the tokenizer from a "
                "text that contains it, or remove it from the input."
            ) from None
        return torch.tensor(ids, dtype=torch.long)

    def decode(self, ids: torch.Tensor | Sequence[int]) -> str:
        """Convert token ids back to a string.

        Args:
            ids: Token ids of shape ``(T,)`` (an integer tensor), or a sequence of ints.

        Returns:
            The decoded string, of length ``T``.

        Raises:
            TypeError: ``ids`` holds non-integers.
            ValueError: ``ids`` is not 1-D, or an id is outside ``[0, vocab_size)``.

        Example:
            >>> CharTokenizer("abc").decode([2, 0, 1])
            'cab'
        """
        if not isinstance(ids, torch.Tensor):
            try:
                ids = torch.as_tensor(ids)
            except (TypeError, ValueError, RuntimeError):
                raise TypeError(
                    f"Expected `ids` to be an integer tensor or a sequence of ints. Received: {ids!r:.60}."
                ) from None
        if ids.numel() == 0:
            return ""
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise TypeError(
                f"Expected integer token ids in `ids`. Received dtype {ids.dtype}. Convert them, e.g. ids.long()."
            )
        if ids.dim() != 1:
            raise ValueError(
                f"Expected `ids` of shape (T,). Received: shape {tuple(ids.shape)}."
                " Decode one sequence at a time, e.g. decode(ids[0])."
            )
        # One min/max pass instead of a Python check per id; also catches negative ids, which
        # list indexing would silently wrap around.
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"Expected token ids in [0, {self.vocab_size}). Received id {bad}. "
                "Were the ids made by a tokenizer with another vocabulary?"
            )
        return "".join(map(self.chars.__getitem__, ids.tolist()))


class NextTokenDataset(Dataset):
    """Every window of ``block_size`` tokens, paired with the window shifted by one.

    Item ``i`` is ``(tokens[i : i + block_size], tokens[i + 1 : i + 1 + block_size])``: inputs
    and next-token targets for a causal language model, as in nanoGPT's ``get_batch`` (which
    samples the same windows at random offsets). Items are views into ``tokens``, not copies.

    Args:
        tokens: Token ids of shape ``(N,)``, integer dtype; stored as int64 (the dtype
            ``cross_entropy`` wants for targets).
        block_size: Window length ``T``.

    Raises:
        TypeError: ``tokens`` is not an integer tensor, or ``block_size`` is not an int.
        ValueError: ``tokens`` is not 1-D, ``block_size < 1``, or ``N < block_size + 1``.

    Example:
        >>> ds = NextTokenDataset(torch.arange(10), block_size=4)
        >>> len(ds)
        6
        >>> ds[0]
        (tensor([0, 1, 2, 3]), tensor([1, 2, 3, 4]))
        >>> ds[-1]
        (tensor([5, 6, 7, 8]), tensor([6, 7, 8, 9]))
    """

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        if not isinstance(tokens, torch.Tensor):
            raise TypeError(
                f"Expected `tokens` to be a torch.Tensor. Received: "
                f"{type(tokens).__name__}. Wrap it, e.g. torch.tensor(tokens)."
            )
        if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise TypeError(
                f"Expected integer token ids in `tokens`. Received dtype "
                f"{tokens.dtype}. Convert them, e.g. tokens.long()."
            )
        if tokens.dim() != 1:
            raise ValueError(
                f"Expected `tokens` of shape (N,). Received: shape "
                f"{tuple(tokens.shape)}. Flatten it, e.g. tokens.flatten()."
            )
        if not isinstance(block_size, int) or isinstance(block_size, bool):
            raise TypeError(f"Expected `block_size` to be an int. Received: block_size={block_size!r}.")
        if block_size < 1:
            raise ValueError(f"Expected `block_size` >= 1. Received: block_size={block_size}.")
        if len(tokens) < block_size + 1:
            raise ValueError(
                f"Expected at least block_size + 1 = {block_size + 1} tokens. "
                f"Received: {len(tokens)} tokens. Use a smaller block_size or a "
                "longer text."
            )
        self.tokens = tokens.long()
        self.block_size = block_size

    def __len__(self) -> int:
        return len(self.tokens) - self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return window ``index``.

        Args:
            index: Window start in ``[-len(self), len(self))``; negative counts from the end.

        Returns:
            ``(x, y)``, both of shape ``(T,)``, int64, with ``y[t] == x[t + 1]`` for
            ``t < T - 1``.

        Raises:
            IndexError: ``index`` is out of range.
        """
        index, n = operator.index(index), len(self)
        if not -n <= index < n:
            raise IndexError(f"Index {index} is out of range for a NextTokenDataset of length {n}.")
        index %= n
        return (self.tokens[index : index + self.block_size], self.tokens[index + 1 : index + 1 + self.block_size])
