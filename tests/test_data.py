"""Tests for mxtrain.data: IDX parsing, Fashion-MNIST, the Austen corpus, tokenizers, LM batches.

Tests that need the installed data sets skip (with the install command) when
the data is missing (or fail, with MXTRAIN_REQUIRE_DATA=1); everything else
runs on small synthetic files.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from mxtrain import config
from mxtrain import data as mxdata
from mxtrain.data import (
    AUSTEN_BOOKS,
    ByteTokenizer,
    CharTokenizer,
    IDXFormatError,
    LMTextDataset,
    get_lm_batches,
    join_corpus,
    load_austen,
    load_fashion_mnist,
    parse_idx,
    read_idx,
    read_lazyload_db,
    split_corpus,
)
from mxtrain.data import austen as austen_mod
from mxtrain.data import fashion_mnist as fm_mod

INSTALL_HINT = "run `bash scripts/install_data.sh`"

# ----------------------------------------------------------------------------- helpers


def idx_bytes(arr: np.ndarray) -> bytes:
    codes = {np.uint8: 0x08, np.int8: 0x09, np.int16: 0x0B, np.int32: 0x0C, np.float32: 0x0D, np.float64: 0x0E}
    code = codes[arr.dtype.type]
    header = bytes([0, 0, code, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
    return header + arr.astype(arr.dtype.newbyteorder(">")).tobytes()


def write_fmnist(root: Path, split: str, images: np.ndarray, labels: np.ndarray, gz: bool = True) -> None:
    prefix = {"train": "train", "test": "t10k"}[split]
    root.mkdir(parents=True, exist_ok=True)
    for stem, arr in ((f"{prefix}-images-idx3-ubyte", images), (f"{prefix}-labels-idx1-ubyte", labels)):
        raw = idx_bytes(arr)
        if gz:
            (root / f"{stem}.gz").write_bytes(gzip.compress(raw))
        else:
            (root / stem).write_bytes(raw)


def fmnist_installed() -> bool:
    r = fm_mod.fashion_mnist_root()
    return all(
        (r / f"{p}-{k}.gz").is_file() or (r / f"{p}-{k}").is_file()
        for p in ("train", "t10k")
        for k in ("images-idx3-ubyte", "labels-idx1-ubyte")
    )


def austen_installed() -> bool:
    try:
        austen_mod.austen_package_dir()
        import rdata  # noqa: F401
    except (FileNotFoundError, ImportError):
        return False
    return True


# With MXTRAIN_REQUIRE_DATA=1 (e.g. in CI after the install step) missing data fails instead of skipping.
REQUIRE_DATA = config.current().require_data

needs_fmnist = pytest.mark.skipif(
    not REQUIRE_DATA and not fmnist_installed(), reason=f"Fashion-MNIST (dataset-fashion-mnist) not installed; {INSTALL_HINT}"
)
needs_austen = pytest.mark.skipif(
    not REQUIRE_DATA and not austen_installed(), reason=f"Austen corpus (r-cran-janeaustenr) or 'rdata' missing; {INSTALL_HINT}"
)

# ----------------------------------------------------------------------------- IDX


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.int32, np.float32, np.float64])
def test_parse_idx_roundtrip_dtypes(dtype):
    rng = np.random.default_rng(0)
    arr = (rng.standard_normal((3, 4, 5)) * 50).astype(dtype)
    out = parse_idx(idx_bytes(arr))
    assert out.dtype == np.dtype(dtype) and out.dtype.isnative
    np.testing.assert_array_equal(out, arr)


def test_read_idx_gz_and_raw(tmp_path):
    arr = np.arange(2 * 28 * 28, dtype=np.uint8).reshape(2, 28, 28)
    (tmp_path / "a").write_bytes(idx_bytes(arr))
    (tmp_path / "a.gz").write_bytes(gzip.compress(idx_bytes(arr)))
    np.testing.assert_array_equal(read_idx(tmp_path / "a"), arr)
    np.testing.assert_array_equal(read_idx(tmp_path / "a.gz"), arr)


def test_parse_idx_empty_dimension():
    out = parse_idx(idx_bytes(np.zeros((0, 28, 28), np.uint8)))
    assert out.shape == (0, 28, 28)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda b: b"\x01" + b[1:], "bad IDX magic"),
        (lambda b: b[:2] + b"\x07" + b[3:], "unknown IDX type code"),
        (lambda b: b[:3] + b"\x00" + b[4:], "0 dimensions"),
        (lambda b: b[:6], "truncated IDX header"),
        (lambda b: b[:-1], "truncated file"),
        (lambda b: b + b"\x00", "trailing data"),
        (lambda b: b[:2], "too short"),
    ],
)
def test_parse_idx_corrupt(mutate, match):
    good = idx_bytes(np.zeros((2, 3, 3), np.uint8))
    with pytest.raises(IDXFormatError, match=match):
        parse_idx(mutate(good))


def test_read_idx_corrupt_gzip(tmp_path):
    gz = gzip.compress(idx_bytes(np.zeros((4, 28, 28), np.uint8)))
    p = tmp_path / "bad.gz"
    p.write_bytes(gz[: len(gz) // 2])  # truncated gzip stream
    with pytest.raises(IDXFormatError, match="corrupt gzip"):
        read_idx(p)
    assert issubclass(IDXFormatError, ValueError)


# ----------------------------------------------------------------------------- Fashion-MNIST


@pytest.mark.parametrize("gz", [True, False])
def test_load_fashion_mnist_synthetic(tmp_path, gz):
    images = np.random.default_rng(1).integers(0, 256, (7, 28, 28), dtype=np.uint8)
    labels = np.array([0, 1, 2, 3, 9, 8, 5], np.uint8)
    write_fmnist(tmp_path, "test", images, labels, gz=gz)
    x, y = load_fashion_mnist("test", root=tmp_path)
    assert x.dtype == torch.uint8 and x.shape == (7, 28, 28)
    assert y.dtype == torch.int64 and y.shape == (7,)
    assert torch.equal(x, torch.from_numpy(images))
    assert y.tolist() == labels.tolist()


def test_load_fashion_mnist_bad_contents(tmp_path):
    imgs = np.zeros((3, 28, 28), np.uint8)
    write_fmnist(tmp_path / "count", "train", imgs, np.zeros(2, np.uint8))
    with pytest.raises(IDXFormatError, match="3 images but"):
        load_fashion_mnist("train", root=tmp_path / "count")
    write_fmnist(tmp_path / "shape", "train", np.zeros((3, 28, 27), np.uint8), np.zeros(3, np.uint8))
    with pytest.raises(IDXFormatError, match=r"\[N, 28, 28\]"):
        load_fashion_mnist("train", root=tmp_path / "shape")
    write_fmnist(tmp_path / "label", "train", imgs, np.array([0, 10, 1], np.uint8))
    with pytest.raises(IDXFormatError, match="out of range"):
        load_fashion_mnist("train", root=tmp_path / "label")
    write_fmnist(tmp_path / "dtype", "train", imgs.astype(np.int32), np.zeros(3, np.uint8))
    with pytest.raises(IDXFormatError, match="uint8"):
        load_fashion_mnist("train", root=tmp_path / "dtype")


def test_load_fashion_mnist_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="bash scripts/install_data.sh"):
        load_fashion_mnist("train", root=tmp_path)
    with pytest.raises(ValueError, match="split"):
        load_fashion_mnist("validation", root=tmp_path)


@needs_fmnist
@pytest.mark.parametrize("split, n", [("train", 60000), ("test", 10000)])
def test_real_fashion_mnist(split, n):
    x, y = load_fashion_mnist(split)
    assert x.shape == (n, 28, 28) and x.dtype == torch.uint8
    assert y.shape == (n,) and y.dtype == torch.int64
    assert int(y.min()) == 0 and int(y.max()) == 9
    # The official splits are exactly balanced.
    assert y.bincount(minlength=10).tolist() == [n // 10] * 10
    assert int(x.max()) == 255 and int(x.min()) == 0
    assert 50 < x.float().mean().item() < 100  # ~72.9 (train), ~73.1 (test)


# ----------------------------------------------------------------------------- R lazy-load DB


def make_lazyload_db(base: Path, objects: dict, compressed=1, kind=b"2") -> None:
    """Write a lazy-load database like R's makeLazyLoadDB (only what our reader needs)."""
    import rdata

    base.parent.mkdir(parents=True, exist_ok=True)
    blob = bytearray()
    variables = {}
    tmp = base.parent / "_obj.rds"
    for name, obj in objects.items():
        rdata.write_rds(tmp, obj, compression=None)
        raw = tmp.read_bytes()
        head = struct.pack(">I", len(raw))
        if compressed == 1:
            rec = head + zlib.compress(raw)
        elif kind == b"2":
            rec = head + kind + bz2.compress(raw)
        elif kind == b"Z":  # R_compress3: raw LZMA2 stream, preset 6 (decoded with a larger dict)
            rec = head + kind + lzma.compress(raw, format=lzma.FORMAT_RAW, filters=[{"id": lzma.FILTER_LZMA2, "preset": 6}])
        elif kind == b"1":
            rec = head + kind + zlib.compress(raw)
        else:
            rec = head + b"0" + raw
        variables[name] = np.array([len(blob), len(rec)], dtype=np.int32)
        blob += rec
    tmp.unlink()
    base.with_suffix(".rdb").write_bytes(bytes(blob))
    index = {"variables": variables, "references": {}, "compressed": np.array([compressed], dtype=np.int32)}
    rdata.write_rds(base.with_suffix(".rdx"), index)


@pytest.mark.parametrize(
    "compressed, kind", [(1, None), (2, b"2"), (2, b"1"), (3, b"Z"), (3, b"0")]
)
def test_read_lazyload_db_synthetic(tmp_path, compressed, kind):
    pytest.importorskip("rdata", reason="pip install rdata")
    objs = {"a": np.array(["one", "two £", ""]), "b": np.array([1.5, 2.5])}
    make_lazyload_db(tmp_path / "Rdata", objs, compressed=compressed, kind=kind)
    out = read_lazyload_db(tmp_path / "Rdata")
    assert list(out["a"]) == ["one", "two £", ""]
    np.testing.assert_allclose(out["b"], [1.5, 2.5])
    assert list(read_lazyload_db(tmp_path / "Rdata", names=["b"])) == ["b"]
    with pytest.raises(KeyError):
        read_lazyload_db(tmp_path / "Rdata", names=["zzz"])


def test_read_lazyload_db_corrupt(tmp_path):
    pytest.importorskip("rdata", reason="pip install rdata")
    make_lazyload_db(tmp_path / "Rdata", {"a": np.array(["x" * 1000])})
    rdb = tmp_path / "Rdata.rdb"
    good = rdb.read_bytes()
    rdb.write_bytes(good[:10])
    with pytest.raises(ValueError, match="truncated"):
        read_lazyload_db(tmp_path / "Rdata")
    rdb.write_bytes(good[:4] + b"\xff" * (len(good) - 4))
    with pytest.raises(ValueError, match="corrupt"):
        read_lazyload_db(tmp_path / "Rdata")
    (tmp_path / "Rdata.rdx").write_bytes(b"not an rds file at all")
    with pytest.raises(ValueError):
        read_lazyload_db(tmp_path / "Rdata")


def test_load_austen_synthetic_package(tmp_path):
    """load_austen on a fake extracted package, so the path logic is tested without the .deb."""
    pytest.importorskip("rdata", reason="pip install rdata")
    pkg = tmp_path / "janeaustenr" / "usr/lib/R/site-library/janeaustenr"
    objs = {var: np.array([title.upper(), "", f"text of {var}"]) for var, title in AUSTEN_BOOKS.items()}
    make_lazyload_db(pkg / "data" / "Rdata", objs)
    for d in (tmp_path, tmp_path / "janeaustenr", pkg):  # data root, extraction dir, package dir
        books = load_austen(data_dir=d)
        assert list(books) == list(AUSTEN_BOOKS.values())
        assert books["Emma"] == "EMMA\n\ntext of emma"
    sub = load_austen(["pride and prejudice", "Persuasion", "emma"], data_dir=tmp_path)
    assert list(sub) == ["Pride & Prejudice", "Persuasion", "Emma"]


def test_load_austen_missing(tmp_path, monkeypatch, mx_config):
    with pytest.raises(FileNotFoundError, match="bash scripts/install_data.sh"):
        load_austen(data_dir=tmp_path)
    mx_config(data_dir=str(tmp_path))
    assert mxdata.data_root() == tmp_path
    monkeypatch.setattr(austen_mod, "_SYSTEM_PKG_DIRS", ())
    with pytest.raises(FileNotFoundError, match="r-cran-janeaustenr"):
        load_austen()


def test_load_austen_unknown_book():
    with pytest.raises(KeyError, match="unknown Austen book"):
        load_austen(["Middlemarch"])


# ----------------------------------------------------------------------------- real Austen corpus


@needs_austen
def test_real_austen_books():
    books = load_austen()
    assert list(books) == [
        "Sense & Sensibility",
        "Pride & Prejudice",
        "Mansfield Park",
        "Emma",
        "Northanger Abbey",
        "Persuasion",
    ]
    for title, text in books.items():
        assert 300_000 < len(text) < 1_200_000, (title, len(text))
    total = sum(map(len, books.values()))
    assert 3_500_000 < total < 4_500_000  # 4,025,022 in janeaustenr 1.0.0
    assert "It is a truth universally acknowledged" in books["Pride & Prejudice"]
    assert "Emma Woodhouse, handsome, clever, and rich" in books["Emma"]
    assert books["Emma"].startswith("EMMA")
    assert len(books["Persuasion"]) < len(books["Emma"])
    one = load_austen("persuasion")
    assert list(one) == ["Persuasion"] and one["Persuasion"] == books["Persuasion"]


@needs_austen
def test_real_austen_lm_tokens():
    train, val, tok = mxdata.austen_lm_tokens(val_fraction=0.1)
    assert isinstance(tok, ByteTokenizer)
    assert train.dtype == torch.int64 and val.dtype == torch.int64
    n = train.numel() + val.numel()
    assert 0.08 < val.numel() / n < 0.12
    x, y = next(get_lm_batches(train, 4, 64, seed=0))
    assert x.shape == y.shape == (4, 64)
    assert 0 <= int(x.min()) and int(x.max()) < 256


# ----------------------------------------------------------------------------- split


def _toy_corpus():
    return {
        "A": "\n".join(f"line {i} of book A" for i in range(200)),
        "B": "\n".join(f"B{i}" for i in range(57)),
    }


def test_split_corpus_deterministic_and_lossless():
    corpus = _toy_corpus()
    tr1, va1 = split_corpus(corpus, 0.1)
    tr2, va2 = split_corpus(dict(corpus), 0.1)
    assert tr1 == tr2 and va1 == va2
    for k, text in corpus.items():
        assert tr1[k] + va1[k] == text
        assert tr1[k].endswith("\n")  # cut at a line start
        assert 0.05 < len(va1[k]) / len(text) <= 0.1
    tr0, va0 = split_corpus(corpus, 0.0)
    assert tr0 == corpus and all(v == "" for v in va0.values())
    with pytest.raises(ValueError):
        split_corpus(corpus, 1.0)


@needs_austen
def test_split_real_austen_deterministic():
    books = load_austen()
    a = split_corpus(books, 0.1)
    b = split_corpus(load_austen(), 0.1)
    assert a == b
    for title in books:
        assert a[0][title] + a[1][title] == books[title]
        assert len(a[1][title]) > 10_000


# ----------------------------------------------------------------------------- tokenizers


@pytest.mark.parametrize("text", ["", "hello", "Pounds: £5 — café 🚀\nnew line\t", "\x00\xff"])
def test_byte_tokenizer_roundtrip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids.dtype == torch.int64 and ids.dim() == 1
    assert ids.numel() == len(text.encode("utf-8"))
    assert (ids >= 0).all() and (ids < tok.vocab_size).all()
    assert tok.decode(ids) == text
    assert tok.decode(ids.tolist()) == text


def test_char_tokenizer_roundtrip():
    text = "It is a truth universally acknowledged, £10,000 a year!\n"
    tok = CharTokenizer.from_text(text)
    assert tok.vocab_size == len(set(text))
    assert tok.chars == sorted(set(text))
    ids = tok.encode(text)
    assert ids.dtype == torch.int64 and int(ids.max()) < tok.vocab_size
    assert tok.decode(ids) == text
    with pytest.raises(KeyError, match="not in the vocabulary"):
        tok.encode("Z")
    tok_unk = CharTokenizer.from_text(text, unk=" ")
    assert tok_unk.decode(tok_unk.encode("aZa")) == "a a"


@needs_austen
def test_char_tokenizer_on_austen():
    text = join_corpus(load_austen(["Emma"]))
    tok = CharTokenizer.from_text(text)
    assert 60 < tok.vocab_size < 100
    sample = text[:5000]
    assert tok.decode(tok.encode(sample)) == sample


# ----------------------------------------------------------------------------- batching


def test_lm_batches_shapes_and_shift():
    tokens = torch.arange(1000)
    batches = list(get_lm_batches(tokens, batch_size=8, seq_len=32, seed=123, num_batches=5))
    assert len(batches) == 5
    for x, y in batches:
        assert x.shape == y.shape == (8, 32)
        assert x.dtype == y.dtype == torch.int64
        assert torch.equal(y, x + 1)  # arange tokens: target = next token
        assert int(x.min()) >= 0 and int(y.max()) <= 999


def test_lm_batches_seeded_reproducible():
    tokens = torch.randint(0, 256, (5000,), generator=torch.Generator().manual_seed(0))
    a = list(get_lm_batches(tokens, 4, 16, seed=7, num_batches=3))
    b = list(get_lm_batches(tokens, 4, 16, seed=7, num_batches=3))
    c = list(get_lm_batches(tokens, 4, 16, seed=8, num_batches=3))
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not all(torch.equal(xa, xc) for (xa, _), (xc, _) in zip(a, c))
    # An explicit generator continues its stream.
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    first = next(get_lm_batches(tokens, 4, 16, generator=g1))
    second = next(get_lm_batches(tokens, 4, 16, generator=g1))
    both = list(get_lm_batches(tokens, 4, 16, generator=g2, num_batches=2))
    assert torch.equal(first[0], both[0][0]) and torch.equal(second[0], both[1][0])


def test_lm_batches_edges():
    # Exactly seq_len + 1 tokens: the only window is the whole stream.
    x, y = next(get_lm_batches(torch.arange(17), 3, 16, seed=0))
    assert torch.equal(x, torch.arange(16).expand(3, 16)) and torch.equal(y, torch.arange(1, 17).expand(3, 16))
    with pytest.raises(ValueError, match="at least"):
        next(get_lm_batches(torch.arange(16), 3, 16))
    with pytest.raises(ValueError):
        next(get_lm_batches(torch.arange(100).view(10, 10), 3, 4))
    with pytest.raises(TypeError):
        LMTextDataset(torch.rand(100), 4)
    # uint8 token storage comes out as int64
    x, _ = next(get_lm_batches(torch.arange(100, dtype=torch.uint8), 2, 8))
    assert x.dtype == torch.int64


def test_lm_text_dataset_windows():
    tokens = torch.arange(101)
    ds = LMTextDataset(tokens, seq_len=10)
    assert len(ds) == 10
    x, y = ds[3]
    assert torch.equal(x, torch.arange(30, 40)) and torch.equal(y, torch.arange(31, 41))
    assert torch.equal(ds[-1][1], torch.arange(91, 101))
    with pytest.raises(IndexError):
        ds[10]
    seen = torch.cat([bx for bx, _ in ds.batches(4)])
    assert seen.shape == (10, 10) and torch.equal(seen.flatten(), torch.arange(100))
    sizes = [bx.shape[0] for bx, _ in ds.batches(4, drop_last=True)]
    assert sizes == [4, 4]
    g = torch.Generator().manual_seed(0)
    shuffled = torch.cat([bx for bx, _ in ds.batches(3, shuffle=True, generator=g)])
    assert sorted(shuffled[:, 0].tolist()) == list(range(0, 100, 10))
    overl = LMTextDataset(tokens, seq_len=10, stride=5)
    assert len(overl) == 19 and torch.equal(overl[1][0], torch.arange(5, 15))
    # Works with a DataLoader (default collate stacks to [batch, seq_len]).
    xb, yb = next(iter(torch.utils.data.DataLoader(ds, batch_size=5)))
    assert xb.shape == yb.shape == (5, 10)


# ----------------------------------------------------------------------------- CLI


def test_cli_info_runs(capsys, monkeypatch, tmp_path, mx_config):
    from mxtrain.data.__main__ import main

    mx_config(data_dir=str(tmp_path))
    mx_config(fashion_mnist_dir=str(tmp_path / "fm"))
    monkeypatch.setattr(austen_mod, "_SYSTEM_PKG_DIRS", ())
    assert main(["info"]) == 0
    assert main(["info", "--check"]) == 1
    out = capsys.readouterr().out
    assert "NOT AVAILABLE" in out and "bash scripts/install_data.sh" in out


@needs_austen
@needs_fmnist
def test_cli_info_installed(capsys):
    from mxtrain.data.__main__ import main

    assert main(["info", "--check"]) == 0
    out = capsys.readouterr().out
    assert "Pride & Prejudice" in out and "(60000, 28, 28)" in out
