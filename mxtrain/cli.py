"""The ``mxtrain`` command line.

    mxtrain study fashion-mnist [--epochs 10] [--subset N] [--configs A,B] [--out DIR] [--device cpu|cuda]

``mxtrain study fashion-mnist --help`` lists every option.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    from mxtrain.examples import fashion_mnist

    parser = argparse.ArgumentParser(prog="mxtrain", description="mxtrain: MX-format training and format studies")
    commands = parser.add_subparsers(dest="command", metavar="command")
    study = commands.add_parser("study", help="format studies (accuracy of a model per number format)")
    studies = study.add_subparsers(dest="study", metavar="study")
    fm = studies.add_parser("fashion-mnist", help="the lab's Fashion-MNIST classifier over MX / elementwise formats",
                            description=fashion_mnist.__doc__.split("\n\n")[0])
    fashion_mnist.build_parser(fm)
    fm.set_defaults(run=fashion_mnist.run_from_args)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:
        sub = {"study": "study"}.get(args.command)
        parser.parse_args([sub, "--help"] if sub else ["--help"])
        return 2
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
