"""Makes the brute-force oracles importable as ``quant_oracles`` (a name no other test dir uses)."""

import importlib.util
import pathlib
import sys

_NAME = "quant_oracles"
if _NAME not in sys.modules:
    _spec = importlib.util.spec_from_file_location(_NAME, pathlib.Path(__file__).with_name("oracles.py"))
    _module = importlib.util.module_from_spec(_spec)
    sys.modules[_NAME] = _module
    _spec.loader.exec_module(_module)
