"""Guard: a clone named ``mxtrain`` imported by its folder name loads the package inside it, ``mxtrain/``.

When the clone's parent folder is on ``sys.path`` (a script run from that folder, the current directory
under ``python -c`` / ``-m``, or pytest collecting a clone named ``mxtrain``), Python finds the clone
before the installed package. Without this file it would import the clone as an empty namespace package
and fail later with "module 'mxtrain' has no attribute ...". With it, ``import mxtrain`` gives the
clone's ``mxtrain/`` package, the code an editable install (``pip install -e``) of the clone runs anyway.
Imported under any other name (pytest collecting a clone with another name) it does nothing.
"""

if __name__ == "mxtrain":
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _package = _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "mxtrain")
    _spec = _util.spec_from_file_location("mxtrain", _os.path.join(_package, "__init__.py"),
                                          submodule_search_locations=[_package])
    if _spec is None or not _os.path.isfile(_spec.origin):
        raise ImportError(f"'import mxtrain' found the folder {_os.path.dirname(_package)}, which has no "
                          f"mxtrain/__init__.py: it is not an mxtrain clone but shadows the installed package. "
                          f"Run from another folder or rename it.", name="mxtrain")
    # The import system returns whatever sys.modules holds under the name once this file has run.
    _sys.modules["mxtrain"] = _module = _util.module_from_spec(_spec)
    try:
        _spec.loader.exec_module(_module)
    except BaseException:
        del _sys.modules["mxtrain"]
        raise
