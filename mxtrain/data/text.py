"""Tokenizers and language-model batching for small text corpora.

* :class:`ByteTokenizer` -- UTF-8 bytes, vocabulary 256, works on any text.
* :class:`CharTokenizer` -- one id per distinct character of a reference text.
* :class:`LMTextDataset` / :func:`get_lm_batches` -- ``(input_ids, target_ids)``
  LongTensors of shape ``[batch, seq_len]`` where ``target_ids`` is
  ``input_ids`` shifted by one token.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Mapping, Sequence

import torch

__all__ = [
    "ByteTokenizer",
    "CharTokenizer",
    "LMTextDataset",
    "get_lm_batches",
    "join_corpus",
]


def join_corpus(corpus: Mapping[str, str] | Iterable[str], sep: str = "\n\n") -> str:
    """Concatenate the texts of a corpus (a dict's values, in order) with ``sep``."""
    texts = corpus.values() if isinstance(corpus, Mapping) else corpus
    return sep.join(texts)


class ByteTokenizer:
    """UTF-8 byte-level tokenizer: ids 0..255, lossless for any ``str``."""

    vocab_size = 256

    def encode(self, text: str) -> torch.Tensor:
        """``str`` -> 1-D int64 tensor of UTF-8 byte values."""
        data = bytearray(text.encode("utf-8"))
        if not data:
            return torch.empty(0, dtype=torch.long)
        return torch.frombuffer(data, dtype=torch.uint8).long()

    def decode(self, ids: torch.Tensor | Sequence[int]) -> str:
        """Ids -> ``str``; invalid UTF-8 (e.g. a cut multi-byte char) becomes U+FFFD."""
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=256)"


class CharTokenizer:
    """Character-level tokenizer with a fixed vocabulary (sorted distinct characters).

    Build it from the training text with :meth:`from_text`; characters not in the
    vocabulary raise ``KeyError`` on encode unless ``unk`` (a character in the
    vocabulary) was given.
    """

    def __init__(self, chars: Iterable[str], unk: str | None = None):
        self.chars: list[str] = list(chars)
        if len(set(self.chars)) != len(self.chars):
            raise ValueError("duplicate characters in vocabulary")
        if any(len(c) != 1 for c in self.chars):
            raise ValueError("vocabulary entries must be single characters")
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        if unk is not None and unk not in self.stoi:
            raise ValueError(f"unk {unk!r} is not in the vocabulary")
        self.unk = unk

    @classmethod
    def from_text(cls, text: str | Iterable[str], unk: str | None = None) -> "CharTokenizer":
        if not isinstance(text, str):
            text = "".join(text)
        return cls(sorted(set(text)), unk=unk)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        if self.unk is None:
            try:
                ids = [self.stoi[c] for c in text]
            except KeyError as e:
                raise KeyError(f"character {e.args[0]!r} not in the vocabulary") from None
        else:
            u = self.stoi[self.unk]
            ids = [self.stoi.get(c, u) for c in text]
        return torch.tensor(ids, dtype=torch.long)

    def decode(self, ids: torch.Tensor | Sequence[int]) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        return "".join(self.chars[int(i)] for i in ids)

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


def _as_tokens(tokens: torch.Tensor | Sequence[int]) -> torch.Tensor:
    t = tokens if isinstance(tokens, torch.Tensor) else torch.as_tensor(tokens)
    if t.dim() != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tuple(t.shape)}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"tokens must be an integer tensor, got {t.dtype}")
    return t


class LMTextDataset(torch.utils.data.Dataset):
    """Next-token windows over one 1-D token stream.

    Item ``i`` is ``(x, y)`` with ``x = tokens[i*stride : i*stride+seq_len]`` and
    ``y = tokens[i*stride+1 : i*stride+seq_len+1]`` (int64, shape ``[seq_len]``).
    The default ``stride = seq_len`` gives non-overlapping windows, which is what
    a validation pass wants. :meth:`random_batch` samples windows at any offset
    for training.
    """

    def __init__(self, tokens: torch.Tensor | Sequence[int], seq_len: int, stride: int | None = None):
        self.tokens = _as_tokens(tokens)
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.seq_len = int(seq_len)
        self.stride = int(stride) if stride is not None else self.seq_len
        if self.stride < 1:
            raise ValueError(f"stride must be >= 1, got {stride}")
        if self.tokens.numel() < self.seq_len + 1:
            raise ValueError(
                f"need at least seq_len + 1 = {self.seq_len + 1} tokens, got {self.tokens.numel()}"
            )
        self._arange = torch.arange(self.seq_len + 1)

    def __len__(self) -> int:
        return (self.tokens.numel() - self.seq_len - 1) // self.stride + 1

    def _windows(self, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.tokens[starts[:, None] + self._arange].long()
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {i} out of range for {n} windows")
        x, y = self._windows(torch.tensor([i * self.stride]))
        return x[0], y[0]

    def random_batch(
        self, batch_size: int, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch_size`` windows at uniformly random offsets (any position, not only multiples of stride)."""
        high = self.tokens.numel() - self.seq_len  # start <= len - seq_len - 1
        starts = torch.randint(0, high, (batch_size,), generator=generator)
        return self._windows(starts)

    def batches(
        self,
        batch_size: int,
        *,
        shuffle: bool = False,
        generator: torch.Generator | None = None,
        drop_last: bool = False,
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One pass over all windows, ``[batch_size, seq_len]`` at a time (the last may be smaller)."""
        n = len(self)
        order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
        for s in range(0, n, batch_size):
            idx = order[s : s + batch_size]
            if drop_last and idx.numel() < batch_size:
                break
            yield self._windows(idx * self.stride)


def get_lm_batches(
    tokens: torch.Tensor | Sequence[int],
    batch_size: int,
    seq_len: int,
    *,
    seed: int | None = 0,
    generator: torch.Generator | None = None,
    num_batches: int | None = None,
    device: torch.device | str | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield random ``(input_ids, target_ids)`` batches of shape ``[batch_size, seq_len]``.

    Offsets are drawn uniformly from a CPU ``torch.Generator``: pass ``generator``
    to continue an existing stream, else one is created with ``manual_seed(seed)``
    (``seed=None`` -> a nondeterministic seed). The same seed and arguments always
    give the same batches. Runs forever unless ``num_batches`` is given.
    """
    ds = LMTextDataset(tokens, seq_len)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if generator is None:
        generator = torch.Generator()
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(int(seed))
    i = 0
    while num_batches is None or i < num_batches:
        x, y = ds.random_batch(batch_size, generator)
        if device is not None:
            x, y = x.to(device), y.to(device)
        yield x, y
        i += 1
