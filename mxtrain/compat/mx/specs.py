"""``mx_specs``: microxcaling's configuration dictionary, its defaults and its command-line flags.

Same keys, defaults, inheritance rules and argparse flags as microxcaling's
``mx/specs.py``:

* :func:`finalize_mx_specs` fills the backward formats from the forward ones
  (``w_elem_format_bp <- w_elem_format``, ``a_elem_format_bp``,
  ``a_elem_format_bp_os`` and ``a_elem_format_bp_ex <- a_elem_format``) and the
  rounding keys from ``round`` (``round_m``, ``round_output``,
  ``round_grad_weight``, ``round_grad_input``, ``round_weight``,
  ``round_mx_output``; the ``round_mx_*_grad_*`` keys from ``round_grad_input``),
  each only where the key is missing or None. It returns None when nothing is
  quantized (no element format, ``bfloat`` and ``fp`` both 0), unless
  ``early_exit=False``.
* :func:`add_mx_args` adds ``--<key>`` for every key (default None, so that
  finalize can tell "not given" apart), ``--<key>`` store_true for keys whose
  default is False, ``--no_<key>`` for keys whose default is True (e.g.
  ``--no_quantize_backprop``, ``--no_bfloat_subnorms``), plus ``--mx_dir`` and
  ``--skip_early_exit``. The hyphenated spellings (``--scale-bits``,
  ``--no-quantize-backprop``) are accepted as aliases.

Differences: ``custom_cuda=True`` does not require CUDA (on the CPU the exact
reference path runs); an unknown key raises ``KeyError`` naming the valid ones.
"""

from __future__ import annotations

import argparse
import collections
import difflib
import json
import os
import traceback

__all__ = [
    "MxSpecs", "get_default_mx_specs", "get_backwards_mx_specs", "apply_mx_specs", "add_mx_args",
    "finalize_mx_specs", "get_mx_specs", "mx_assert_test", "DEFAULTS", "HELP",
]

_ASSERT_MODE = os.environ.get("MX_ASSERT", "False")

# key -> (default, help); order as in microxcaling
_SPEC_TABLE = (
    ("scale_bits", 0, "Bits (sign + magnitude) to use for shared exponent/scale (0 means 8)"),
    ("w_elem_format", None, "Weight MX elem format, one of {fp8_e5m2, fp8_e4m3, fp6_e3m2, fp6_e2m3, "
                            "fp4_e2m1, int8, int4, int2}"),
    ("a_elem_format", None, "Activation MX elem format. See w_elem_format"),
    ("w_elem_format_bp", None, "Backpass weight MX elem format. See w_elem_format"),
    ("a_elem_format_bp", None, "Backpass stashed activation MX elem format. See w_elem_format"),
    ("a_elem_format_bp_ex", None, "Backpass act (grad) MX elem format for the weight gradient. See w_elem_format"),
    ("a_elem_format_bp_os", None, "Backpass act (grad) MX elem format for the input gradient. See w_elem_format"),
    ("mx_flush_fp32_subnorms", False, "MX quantization flushes blocks with subnormal shared scale to zero"),
    ("shared_exp_method", "max", "Shared exponent calculation method. Options: max, none"),
    ("block_size", 0, "mx shared exponent block size (0: one scale for the whole axis)"),
    ("bfloat", 0, "BfloatX format (8exp + sign + mantissa). Only one of bfloat or fp can be used"),
    ("fp", 0, "fpX format (5exp + sign + mantissa). Only one of bfloat or fp can be used"),
    ("bfloat_subnorms", True, "Bfloat/FP supports subnorms"),
    ("quantize_backprop", True, "Enable mx/bfloat quantization on backward pass"),
    ("round", "nearest", "Global rounding mode. Choices: nearest, floor, even"),
    ("round_m", "nearest", "ADAM optimizer m and v rounding mode"),
    ("round_weight", "nearest", "Weight bfloat rounding mode (W in WAGE)"),
    ("round_output", "nearest", "Activation bfloat rounding mode (A in WAGE)"),
    ("round_grad_weight", "nearest", "Weight update rounding mode (G in WAGE)"),
    ("round_grad_input", "nearest", "Error gradient rounding mode (E in WAGE)"),
    ("round_mx_output", "nearest", "Forward pass mx rounding mode"),
    ("round_mx_input_grad_input", "nearest", ""),
    ("round_mx_weight_grad_input", "nearest", ""),
    ("round_mx_grad_output_grad_input", "nearest", ""),
    ("round_mx_input_grad_weight", "nearest", ""),
    ("round_mx_grad_output_grad_weight", "nearest", ""),
    ("softmax_exp2", False, "Softmax uses 2^x instead of e^x"),
    ("vec_use_exp2", False, "Use 2^x to compute e^x"),
    ("vec_use_recip", False, "Use 1/x to compute division"),
    ("custom_cuda", False, "Enable custom CUDA kernels for quantization (mxtrain: its GPU kernels)"),
)
DEFAULTS = {k: v for k, v, _ in _SPEC_TABLE}
HELP = {k: h for k, _, h in _SPEC_TABLE}

_ELEM_FORMAT_KEYS = ("w_elem_format", "a_elem_format", "w_elem_format_bp", "a_elem_format_bp",
                     "a_elem_format_bp_os", "a_elem_format_bp_ex")
# (key, inherits from), applied in this order by finalize_mx_specs
_INHERIT = (
    ("w_elem_format_bp", "w_elem_format"),
    ("a_elem_format_bp", "a_elem_format"),
    ("a_elem_format_bp_os", "a_elem_format"),
    ("a_elem_format_bp_ex", "a_elem_format"),
    ("round_m", "round"),
    ("round_output", "round"),
    ("round_grad_weight", "round"),
    ("round_grad_input", "round"),
    ("round_weight", "round"),
    ("round_mx_output", "round"),
    ("round_mx_input_grad_input", "round_grad_input"),
    ("round_mx_weight_grad_input", "round_grad_input"),
    ("round_mx_grad_output_grad_input", "round_grad_input"),
    ("round_mx_input_grad_weight", "round_grad_input"),
    ("round_mx_grad_output_grad_weight", "round_grad_input"),
)


def _unknown_key(key) -> KeyError:
    close = difflib.get_close_matches(str(key), list(DEFAULTS), n=3)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    return KeyError(f"Unknown key {key!r} passed to mx specs{hint}; valid keys: {', '.join(DEFAULTS)}")


class MxSpecs(collections.UserDict):
    """The ``mx_specs`` dictionary: every key of microxcaling with its default, unknown keys refused."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.help_strings = dict(HELP)
        for k, v in DEFAULTS.items():
            self.data.setdefault(k, v)
        for k in self.data:
            if k not in DEFAULTS:
                raise _unknown_key(k)

    def __setitem__(self, key, value):
        if key not in DEFAULTS:
            raise _unknown_key(key)
        self.data[key] = value

    def safe_json(self, indent=None) -> str:
        return json.dumps(self.data, indent=indent, default=lambda o: f"<<non-serializable: {type(o).__qualname__}>>")

    def __str__(self) -> str:
        return self.safe_json(indent=4)


def get_default_mx_specs() -> MxSpecs:
    """Specs that quantize nothing."""
    return MxSpecs()


def get_backwards_mx_specs(specs):
    """The specs the backward pass uses: a no-quantization copy when ``quantize_backprop`` is False."""
    bspecs = specs.copy()
    if bspecs["quantize_backprop"] is False or bspecs["quantize_backprop"] == 0:
        for k in _ELEM_FORMAT_KEYS:
            bspecs[k] = None
        bspecs["block_size"] = 0
        bspecs["bfloat"] = 0
        bspecs["fp"] = 0
    return bspecs


def apply_mx_specs(mx_specs, default_mx_specs=None) -> MxSpecs:
    """A full :class:`MxSpecs`: the non-None entries of ``mx_specs`` over ``default_mx_specs`` (or the defaults)."""
    if not default_mx_specs:
        default_mx_specs = get_default_mx_specs()
    if not mx_specs:
        return default_mx_specs
    for k in mx_specs:
        if mx_specs[k] is not None:
            if k not in default_mx_specs:
                raise _unknown_key(k)
            default_mx_specs[k] = mx_specs[k]
    return default_mx_specs


def _aliases(flag: str) -> list[str]:
    hyphen = flag.replace("_", "-")
    return [flag] if hyphen == flag else [flag, hyphen]


def add_mx_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add one flag per spec key to ``parser`` (microxcaling's spelling; see the module docstring)."""
    group = parser.add_argument_group("mx", "MX specs")
    group.add_argument("--mx_dir", type=str, default=None, help="Path to mx library")
    for k, v in DEFAULTS.items():
        help_str = HELP[k] or "No help string"
        if "elem_format" in k:
            group.add_argument(*_aliases("--" + k), dest=k, type=str, default=v, help=help_str)
        elif type(v) is bool and v is False:
            group.add_argument(*_aliases("--" + k), dest=k, action="store_true", help=help_str)
        elif type(v) is bool and v is True:
            group.add_argument(*_aliases("--no_" + k), dest="no_" + k, action="store_true", help=help_str)
        else:
            group.add_argument(*_aliases("--" + k), dest=k, type=type(v), default=None, help=help_str)
    group.add_argument("--skip_early_exit", "--skip-early-exit", dest="skip_early_exit", action="store_true",
                       default=False, help="Don't early exit if no quantization is specified")
    return parser


def finalize_mx_specs(specs, early_exit: bool = True):
    """Resolve the keys that depend on others (see the module docstring); None when nothing is quantized.

    Like microxcaling, the inherited keys are also written into ``specs`` itself.
    """
    if early_exit and not any(specs.get(k, 0) for k in _ELEM_FORMAT_KEYS + ("bfloat", "fp")):
        return None
    for key, base in _INHERIT:
        if (key not in specs or specs[key] is None) and base in specs:
            specs[key] = specs[base]
    return apply_mx_specs(specs, get_default_mx_specs())


def get_mx_specs(parsed_args: argparse.Namespace):
    """Finalized specs from ``parser.parse_args()`` of a parser set up by :func:`add_mx_args`."""
    parsed = {}
    for k, v in DEFAULTS.items():
        if type(v) is bool and v is True:
            if hasattr(parsed_args, "no_" + k):
                parsed[k] = not getattr(parsed_args, "no_" + k)
        elif hasattr(parsed_args, k):
            parsed[k] = getattr(parsed_args, k)
    early_exit = not getattr(parsed_args, "skip_early_exit", False)
    return finalize_mx_specs(parsed, early_exit=early_exit)


def mx_assert_test(mx_specs) -> None:
    """With ``MX_ASSERT=True`` in the environment, refuse ``mx_specs=None`` (microxcaling's debugging aid)."""
    if _ASSERT_MODE == "True" and mx_specs is None:
        stack = traceback.extract_stack()
        f1, f2 = stack[-2], stack[-3]
        raise ValueError(f"MX assert test failed!\nmx_specs is None in function {f1.name}\n"
                         f"Called from {f2.filename}, line {f2.lineno}\n  {f2.line}")


class MxSpecsModule:
    """What microxcaling's modules share: ``mx_specs`` (``mx_none`` when None: the plain torch layer
    runs), a ``name``, and the methods that change them later. Mixed in before the torch module."""

    def _init_mx(self, mx_specs, name):
        mx_assert_test(mx_specs)
        self.mx_none = mx_specs is None
        self.name = name
        self.mx_specs = apply_mx_specs(mx_specs)

    def apply_mx_specs(self, mx_specs):
        self.mx_none = mx_specs is None
        self.mx_specs = apply_mx_specs(mx_specs)

    def append_name(self, postfix):
        self.name += postfix
