"""Offline data sets for mxtrain: Jane Austen's novels (language modelling) and Fashion-MNIST.

Nothing is downloaded at run time; install the data once with
``bash scripts/install_data.sh`` and check it with ``python -m mxtrain.data info``.
"""

from __future__ import annotations

from mxtrain.data.austen import (
    AUSTEN_BOOKS,
    INSTALL_COMMAND,
    austen_package_dir,
    data_root,
    load_austen,
    read_lazyload_db,
    split_corpus,
)
from mxtrain.data.fashion_mnist import (
    CLASSES as FASHION_MNIST_CLASSES,
    IDXFormatError,
    load_fashion_mnist,
    parse_idx,
    read_idx,
)
from mxtrain.data.text import (
    ByteTokenizer,
    CharTokenizer,
    LMTextDataset,
    get_lm_batches,
    join_corpus,
)

__all__ = [
    "AUSTEN_BOOKS",
    "FASHION_MNIST_CLASSES",
    "INSTALL_COMMAND",
    "ByteTokenizer",
    "CharTokenizer",
    "IDXFormatError",
    "LMTextDataset",
    "austen_lm_tokens",
    "austen_package_dir",
    "data_root",
    "get_lm_batches",
    "join_corpus",
    "load_austen",
    "load_fashion_mnist",
    "parse_idx",
    "read_idx",
    "read_lazyload_db",
    "split_corpus",
]


def austen_lm_tokens(
    val_fraction: float = 0.1,
    tokenizer: ByteTokenizer | CharTokenizer | None = None,
    books=None,
    data_dir=None,
):
    """Austen corpus ready for language modelling.

    Splits each book with :func:`split_corpus`, joins the parts with blank lines
    and encodes them. ``tokenizer`` defaults to :class:`ByteTokenizer`.

    Returns:
        ``(train_ids, val_ids, tokenizer)``: 1-D int64 tensors and the tokenizer used.
    """
    corpus = load_austen(books=books, data_dir=data_dir)
    train, val = split_corpus(corpus, val_fraction)
    tok = tokenizer if tokenizer is not None else ByteTokenizer()
    return tok.encode(join_corpus(train)), tok.encode(join_corpus(val)), tok
