"""Jane Austen's six novels, read from the Debian package ``r-cran-janeaustenr``.

The package is *not* installed with apt (that would pull in R). Instead
``scripts/install_data.sh`` runs ``apt-get download r-cran-janeaustenr`` and
unpacks the ``.deb`` with ``dpkg-deb -x`` into ``$MXTRAIN_DATA_DIR/janeaustenr``
(default ``~/.cache/mxtrain/janeaustenr``).

The texts live in an R *lazy-load database* (``data/Rdata.rdx`` + ``data/Rdata.rdb``).
The PyPI package ``rdata`` (1.1) cannot open such a database directly, but it
can parse the pieces: the ``.rdx`` index is an ordinary gzip-compressed RDS file
(a list ``variables`` mapping each name to ``(offset, length)`` inside the
``.rdb``), and each ``.rdb`` record is a compressed, serialized R object. This
module decompresses the records itself and hands them to ``rdata``'s parser.

Nothing is downloaded at run time.
"""

from __future__ import annotations

import bz2
import functools
import lzma
import os
import re
import struct
import zlib
from pathlib import Path
from typing import Any, Iterable, Mapping

from mxtrain import config

__all__ = [
    "AUSTEN_BOOKS",
    "INSTALL_COMMAND",
    "austen_package_dir",
    "data_root",
    "load_austen",
    "read_lazyload_db",
    "split_corpus",
]

INSTALL_COMMAND = "bash scripts/install_data.sh"

#: R variable name -> book title, in the order used by ``janeaustenr::austen_books()``.
AUSTEN_BOOKS: dict[str, str] = {
    "sensesensibility": "Sense & Sensibility",
    "prideprejudice": "Pride & Prejudice",
    "mansfieldpark": "Mansfield Park",
    "emma": "Emma",
    "northangerabbey": "Northanger Abbey",
    "persuasion": "Persuasion",
}

# Where dpkg-deb -x puts the R package inside the extraction folder.
_PKG_SUBPATH = Path("usr/lib/R/site-library/janeaustenr")
# A system-wide R install of the package (apt-get install r-cran-janeaustenr), used as a fallback.
_SYSTEM_PKG_DIRS = (
    Path("/usr/lib/R/site-library/janeaustenr"),
    Path("/usr/local/lib/R/site-library/janeaustenr"),
)


def data_root() -> Path:
    """Root folder for mxtrain's installed data: ``$MXTRAIN_DATA_DIR`` or ``~/.cache/mxtrain``."""
    env = config.current().data_dir
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "mxtrain"


def _is_pkg_dir(p: Path) -> bool:
    return (p / "data" / "Rdata.rdx").is_file() and (p / "data" / "Rdata.rdb").is_file()


def _candidate_pkg_dirs(data_dir: str | os.PathLike | None) -> list[Path]:
    if data_dir is not None:
        base = Path(data_dir).expanduser()
        # Accept the data root, the extraction folder, or the R package folder itself.
        return [base / "janeaustenr" / _PKG_SUBPATH, base / _PKG_SUBPATH, base]
    root = data_root()
    return [root / "janeaustenr" / _PKG_SUBPATH, *_SYSTEM_PKG_DIRS]


def austen_package_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """Return the folder of the unpacked R package ``janeaustenr``.

    Raises:
        FileNotFoundError: if it is not installed, naming the install command.
    """
    candidates = _candidate_pkg_dirs(data_dir)
    for c in candidates:
        if _is_pkg_dir(c):
            return c
    tried = "\n  ".join(str(c / "data" / "Rdata.rdx") for c in candidates)
    raise FileNotFoundError(
        "Jane Austen corpus (Debian package r-cran-janeaustenr) not found. Looked for:\n  "
        f"{tried}\n"
        f"Install it with:  {INSTALL_COMMAND}\n"
        "(it runs `apt-get download r-cran-janeaustenr` and unpacks it with `dpkg-deb -x` "
        "into $MXTRAIN_DATA_DIR/janeaustenr, default ~/.cache/mxtrain/janeaustenr)."
    )


def _import_rdata():
    try:
        import rdata  # noqa: PLC0415
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "Reading the Jane Austen corpus needs the PyPI package 'rdata': pip install 'rdata>=1.0'"
        ) from e
    return rdata


def _decompress_record(blob: bytes, compressed: int, name: str) -> bytes:
    """Decompress one .rdb record as R's lazyLoadDBfetch does (R_decompress1/2/3)."""
    if len(blob) < 4:
        raise ValueError(f"lazy-load record {name!r} is truncated ({len(blob)} bytes)")
    (outlen,) = struct.unpack(">I", blob[:4])
    try:
        if compressed in (0,):
            out = blob[4:]
        elif compressed == 1:  # zlib, the default of makeLazyLoadDB / LazyData
            out = zlib.decompress(blob[4:])
        elif compressed in (2, 3):  # type byte then payload
            kind = blob[4:5]
            payload = blob[5:]
            if kind == b"0":
                out = payload
            elif kind == b"1":
                out = zlib.decompress(payload)
            elif kind == b"2":
                out = bz2.decompress(payload)
            elif kind == b"Z":
                out = lzma.decompress(
                    payload,
                    format=lzma.FORMAT_RAW,
                    filters=[{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}],
                )
            else:
                raise ValueError(f"unknown compression type byte {kind!r}")
        else:
            raise ValueError(f"unknown lazy-load compression {compressed!r}")
    except (zlib.error, OSError, lzma.LZMAError, EOFError) as e:
        raise ValueError(f"lazy-load record {name!r} is corrupt: {e}") from e
    if len(out) != outlen:
        raise ValueError(
            f"lazy-load record {name!r}: decompressed {len(out)} bytes, header says {outlen}"
        )
    return out


def read_lazyload_db(
    base: str | os.PathLike, names: Iterable[str] | None = None
) -> dict[str, Any]:
    """Read objects from an R lazy-load database ``<base>.rdx`` / ``<base>.rdb``.

    Args:
        base: path without extension, e.g. ``.../janeaustenr/data/Rdata``.
        names: variables to read (default: all).

    Returns:
        name -> object as converted by ``rdata.conversion.convert`` (a character
        vector becomes a numpy array of ``str``).
    """
    rdata = _import_rdata()
    base = Path(base)
    rdx, rdb = base.with_suffix(".rdx"), base.with_suffix(".rdb")
    for p in (rdx, rdb):
        if not p.is_file():
            raise FileNotFoundError(f"R lazy-load database file missing: {p}")
    try:
        index = rdata.conversion.convert(rdata.parser.parse_file(rdx, extension=".rds"))
    except Exception as e:  # rdata raises assorted errors on garbage input
        raise ValueError(f"cannot parse lazy-load index {rdx}: {e}") from e
    try:
        variables = {str(k): v for k, v in index["variables"].items()}
        compressed = int(_scalar(index.get("compressed", 1)))
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{rdx} is not a lazy-load index: {e}") from e
    wanted = list(variables) if names is None else list(names)
    missing = [n for n in wanted if n not in variables]
    if missing:
        raise KeyError(f"{missing} not in {rdx} (has {sorted(variables)})")
    out: dict[str, Any] = {}
    with open(rdb, "rb") as f:
        for name in wanted:
            offset, length = (int(x) for x in variables[name])
            f.seek(offset)
            blob = f.read(length)
            if len(blob) != length:
                raise ValueError(f"{rdb} is truncated: record {name!r} needs {offset + length} bytes")
            raw = _decompress_record(blob, compressed, name)
            try:
                out[name] = rdata.conversion.convert(rdata.parser.parse_data(raw, extension=".rds"))
            except Exception as e:
                raise ValueError(f"cannot parse record {name!r} of {rdb}: {e}") from e
    return out


def _scalar(x: Any) -> Any:
    try:
        return x[0]
    except (TypeError, IndexError, KeyError):
        return x


def _norm(s: str) -> str:
    return re.sub(r"[^a-z0-9]", "", s.lower().replace("&", "and"))


_ALIASES: dict[str, str] = {}
for _var, _title in AUSTEN_BOOKS.items():
    _ALIASES[_norm(_var)] = _var
    _ALIASES[_norm(_title)] = _var


def _resolve_books(books: Iterable[str] | str | None) -> list[str]:
    if books is None:
        return list(AUSTEN_BOOKS)
    if isinstance(books, str):
        books = [books]
    out = []
    for b in books:
        var = _ALIASES.get(_norm(b))
        if var is None:
            raise KeyError(f"unknown Austen book {b!r}; choose from {list(AUSTEN_BOOKS.values())}")
        if var not in out:
            out.append(var)
    return out


@functools.lru_cache(maxsize=4)
def _load_all(pkg_dir: str) -> tuple[tuple[str, str], ...]:
    objs = read_lazyload_db(Path(pkg_dir) / "data" / "Rdata", names=list(AUSTEN_BOOKS))
    texts = []
    for var in AUSTEN_BOOKS:
        lines = objs[var]
        # NA_character_ would come back as None; the shipped data has none.
        texts.append((var, "\n".join("" if s is None else str(s) for s in lines)))
    return tuple(texts)


def load_austen(
    books: Iterable[str] | str | None = None, data_dir: str | os.PathLike | None = None
) -> dict[str, str]:
    """Load Jane Austen's novels as ``{title: full text}``.

    Args:
        books: titles (``"Pride & Prejudice"``, ``"Pride and Prejudice"``) or R
            names (``"prideprejudice"``), case-insensitive; default all six, in
            the package order (Sense & Sensibility, Pride & Prejudice,
            Mansfield Park, Emma, Northanger Abbey, Persuasion).
        data_dir: where the corpus was installed (the data root, the
            extraction folder, or the R package folder). Default:
            ``$MXTRAIN_DATA_DIR/janeaustenr`` or ``~/.cache/mxtrain/janeaustenr``,
            then a system-wide R install.

    Each text is the package's lines joined with ``"\\n"`` (blank lines kept).

    Raises:
        FileNotFoundError: the corpus is not installed (message names ``bash scripts/install_data.sh``).
        ImportError: the ``rdata`` package is missing.
        ValueError: the database is corrupt.
    """
    wanted = _resolve_books(books)
    pkg = austen_package_dir(data_dir)
    all_texts = dict(_load_all(str(pkg.resolve())))
    return {AUSTEN_BOOKS[v]: all_texts[v] for v in wanted}


def split_corpus(
    corpus: Mapping[str, str], val_fraction: float = 0.1
) -> tuple[dict[str, str], dict[str, str]]:
    """Deterministic train/validation split: the tail of each text goes to validation.

    For every text, the last ``val_fraction`` of its characters (moved forward
    to the next line start, so no line is cut) becomes the validation part and
    the rest the training part. Every book is represented in both, and train and
    validation never share a passage. No randomness is involved: the same
    corpus and fraction always give the same split.

    Returns:
        ``(train, val)``: two dicts with the same keys as ``corpus``.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    train: dict[str, str] = {}
    val: dict[str, str] = {}
    for name, text in corpus.items():
        cut = len(text) - int(round(len(text) * val_fraction))
        if 0 < cut < len(text):
            nl = text.find("\n", cut)
            if nl != -1:
                cut = nl + 1
        train[name] = text[:cut]
        val[name] = text[cut:]
    return train, val
