"""Entry point of the ``mxtrain`` command: ``mxtrain/cli.py`` loaded without importing the mxtrain package.

The package's ``__init__`` imports torch (seconds of CPU); ``mxtrain --help`` and
``mxtrain --version`` should not wait for it. A command that runs imports what it needs.
"""

import importlib.util
import os
import sys


def _load_cli():
    spec = importlib.util.find_spec("mxtrain")  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("mxtrain_cli: the mxtrain package is not installed")
    path = os.path.join(list(spec.submodule_search_locations)[0], "cli.py")
    cli_spec = importlib.util.spec_from_file_location("_mxtrain_cli", path)
    module = importlib.util.module_from_spec(cli_spec)
    cli_spec.loader.exec_module(module)
    return module


def main(argv=None) -> int:
    return _load_cli().main(argv)


if __name__ == "__main__":
    sys.exit(main())
