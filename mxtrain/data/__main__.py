"""``python -m mxtrain.data info [--check]``: show which data sets are installed."""

from __future__ import annotations

import argparse
import sys

from mxtrain.data import austen, fashion_mnist


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _info_fashion_mnist() -> bool:
    root = fashion_mnist.fashion_mnist_root()
    print(f"Fashion-MNIST  ({root})")
    ok = True
    for split in ("train", "test"):
        try:
            images, labels = fashion_mnist.load_fashion_mnist(split)
        except (FileNotFoundError, ValueError) as e:
            print(f"  {split:5s}: NOT AVAILABLE: {str(e).splitlines()[0]}")
            ok = False
            continue
        counts = labels.bincount(minlength=10).tolist()
        print(
            f"  {split:5s}: images {tuple(images.shape)} {images.dtype}, labels {tuple(labels.shape)} "
            f"{labels.dtype}, per class {counts}"
        )
    if ok:
        files = sorted(p for p in root.iterdir() if p.is_file())
        for p in files:
            print(f"    {p.name:32s} {_human(p.stat().st_size)}")
    return ok


def _info_austen() -> bool:
    print(f"Jane Austen    (data root {austen.data_root()}, $MXTRAIN_DATA_DIR)")
    try:
        pkg = austen.austen_package_dir()
        books = austen.load_austen()
    except (FileNotFoundError, ImportError, ValueError) as e:
        print("  NOT AVAILABLE: " + str(e).replace("\n", "\n  "))
        return False
    print(f"  package: {pkg}")
    total = 0
    for title, text in books.items():
        total += len(text)
        print(
            f"  {title:22s} {len(text):>9,d} chars {text.count(chr(10)) + 1:>7,d} lines "
            f"{len(text.encode('utf-8')):>9,d} UTF-8 bytes"
        )
    all_text = "".join(books.values())
    print(f"  total: {len(books)} books, {total:,d} chars, {len(set(all_text))} distinct characters")
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mxtrain.data", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    info = sub.add_parser("info", help="print which data sets are installed, with sizes")
    info.add_argument("--check", action="store_true", help="exit 1 if any data set is missing")
    args = p.parse_args(argv)
    if args.cmd == "info":
        ok = _info_fashion_mnist()
        print()
        ok = _info_austen() and ok
        if not ok:
            print(f"\nTo install the missing data: {austen.INSTALL_COMMAND}")
        return 1 if (args.check and not ok) else 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
