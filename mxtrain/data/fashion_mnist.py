"""Fashion-MNIST from the Debian package ``dataset-fashion-mnist``.

``apt-get install dataset-fashion-mnist`` (done by ``scripts/install_data.sh``)
puts gzipped IDX files in ``/usr/share/datasets/fashion-mnist/``:
``train-images-idx3-ubyte.gz`` (60000x28x28), ``train-labels-idx1-ubyte.gz``,
``t10k-images-idx3-ubyte.gz`` (10000x28x28), ``t10k-labels-idx1-ubyte.gz``.
Uncompressed copies (same names without ``.gz``) are accepted too.
"""

from __future__ import annotations

import gzip
import os
import zlib
from pathlib import Path

import numpy as np
import torch

from mxtrain import config

__all__ = [
    "CLASSES",
    "DEFAULT_ROOT",
    "IDXFormatError",
    "fashion_mnist_root",
    "load_fashion_mnist",
    "parse_idx",
    "read_idx",
]

INSTALL_COMMAND = "bash scripts/install_data.sh"
DEFAULT_ROOT = Path("/usr/share/datasets/fashion-mnist")

CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)

_SPLIT_PREFIX = {"train": "train", "test": "t10k"}
_SPLIT_SIZE = {"train": 60000, "test": 10000}

# IDX type code -> big-endian numpy dtype
_IDX_DTYPES = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


class IDXFormatError(ValueError):
    """An IDX file is corrupt, truncated, or not what was expected."""


def parse_idx(data: bytes, name: str = "<bytes>") -> np.ndarray:
    """Parse the bytes of an (uncompressed) IDX file into a native-endian numpy array.

    Checks the magic number (two zero bytes, a known type code, a dimension
    count) and that the payload size equals the product of the dimensions.
    """
    if len(data) < 4:
        raise IDXFormatError(f"{name}: too short for an IDX header ({len(data)} bytes)")
    if data[0] != 0 or data[1] != 0:
        raise IDXFormatError(
            f"{name}: bad IDX magic {data[:4].hex()} (must start with 0000); not an IDX file?"
        )
    code, ndim = data[2], data[3]
    if code not in _IDX_DTYPES:
        raise IDXFormatError(f"{name}: unknown IDX type code 0x{code:02x}")
    if ndim == 0:
        raise IDXFormatError(f"{name}: IDX file with 0 dimensions")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise IDXFormatError(f"{name}: truncated IDX header (needs {header} bytes, has {len(data)})")
    shape = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    dtype = _IDX_DTYPES[code]
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    got = len(data) - header
    if got != expected:
        raise IDXFormatError(
            f"{name}: IDX payload is {got} bytes but shape {shape} of {dtype.name} needs {expected}"
            + (" (truncated file?)" if got < expected else " (trailing data)")
        )
    arr = np.frombuffer(data, dtype=dtype, offset=header).reshape(shape)
    return arr.astype(dtype.newbyteorder("="), copy=True)


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an IDX file, gzipped (by magic bytes) or not. See :func:`parse_idx`."""
    path = Path(path)
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise IDXFormatError(f"{path}: corrupt gzip data: {e}") from e
    return parse_idx(raw, name=str(path))


def fashion_mnist_root(root: str | os.PathLike | None = None) -> Path:
    """The Fashion-MNIST folder: ``root``, else ``$MXTRAIN_FASHION_MNIST_DIR``, else the Debian path."""
    if root is not None:
        return Path(root).expanduser()
    env = config.current().fashion_mnist_dir
    return Path(env).expanduser() if env else DEFAULT_ROOT


def _find(root: Path, stem: str) -> Path:
    for cand in (root / f"{stem}.gz", root / stem):
        if cand.is_file():
            return cand
    raise FileNotFoundError(
        f"Fashion-MNIST file {stem}[.gz] not found in {root}.\n"
        f"Install the Debian package dataset-fashion-mnist with:  {INSTALL_COMMAND}\n"
        "(or: apt-get install dataset-fashion-mnist)"
    )


def load_fashion_mnist(
    split: str = "train", root: str | os.PathLike | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Load a Fashion-MNIST split.

    Args:
        split: ``"train"`` (60000 images) or ``"test"`` (10000 images).
        root: folder with the IDX files (default ``/usr/share/datasets/fashion-mnist``
            or ``$MXTRAIN_FASHION_MNIST_DIR``).

    Returns:
        ``(images, labels)``: uint8 tensor ``[N, 28, 28]`` (0..255) and int64
        tensor ``[N]`` (0..9, see :data:`CLASSES`).

    Raises:
        FileNotFoundError: files missing (message names the install command).
        IDXFormatError: a file is corrupt or has an unexpected shape/type.
    """
    if split not in _SPLIT_PREFIX:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    r = fashion_mnist_root(root)
    prefix = _SPLIT_PREFIX[split]
    img_path = _find(r, f"{prefix}-images-idx3-ubyte")
    lbl_path = _find(r, f"{prefix}-labels-idx1-ubyte")
    images = read_idx(img_path)
    labels = read_idx(lbl_path)
    if images.dtype != np.uint8 or images.ndim != 3 or images.shape[1:] != (28, 28):
        raise IDXFormatError(
            f"{img_path}: expected uint8 images [N, 28, 28], got {images.dtype} {images.shape}"
        )
    if labels.dtype != np.uint8 or labels.ndim != 1:
        raise IDXFormatError(f"{lbl_path}: expected uint8 labels [N], got {labels.dtype} {labels.shape}")
    if labels.shape[0] != images.shape[0]:
        raise IDXFormatError(
            f"{img_path} has {images.shape[0]} images but {lbl_path} has {labels.shape[0]} labels"
        )
    if labels.size and int(labels.max()) >= len(CLASSES):
        raise IDXFormatError(f"{lbl_path}: label {int(labels.max())} out of range 0..9")
    return torch.from_numpy(images), torch.from_numpy(labels.astype(np.int64))
