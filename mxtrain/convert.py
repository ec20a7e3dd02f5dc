"""``mxtrain.convert``: swap the torch modules of a model for MX ones, in place and undoably.

    handle = mxtrain.convert(model, recipe=mxtrain.MXFP8Recipe(elemwise_format="bfloat16"))
    loss = model(x).sum(); loss.backward()        # MX GEMMs, bfloat16 activations
    handle.undo()                                 # the original modules are back

What is replaced (exact types; subclasses are left alone):

| torch module | becomes |
|---|---|
| ``nn.Linear`` | :class:`mxtrain.Linear` |
| ``nn.Conv1d``, ``Conv2d``, ``Conv3d`` | :class:`mxtrain.modules.conv.Conv1d` / ``Conv2d`` / ``Conv3d`` (MX GEMM operands per the recipe's roles) |
| ``nn.ConvTranspose1d``, ``ConvTranspose2d``, ``ConvTranspose3d`` | :class:`mxtrain.modules.conv.ConvTranspose1d` / ``2d`` / ``3d`` (same) |
| ``nn.LayerNorm`` (last dim) | :class:`mxtrain.LayerNorm` (output rounded to ``elemwise_format``) |
| ``nn.RMSNorm`` (last dim) | :class:`mxtrain.RMSNorm` (same) |
| ``nn.GroupNorm`` | :class:`mxtrain.modules.groupnorm.GroupNorm` (every step rounded to ``elemwise_format``, as microxcaling) |
| ``nn.BatchNorm1d``, ``BatchNorm2d``, ``BatchNorm3d`` | :class:`mxtrain.modules.batchnorm.BatchNorm1d` / ``2d`` / ``3d`` (same; running statistics updated exactly as torch) |
| ``nn.ReLU``, ``ReLU6``, ``LeakyReLU``, ``GELU``, ``SiLU``, ``Sigmoid``, ``Tanh``, ``Softmax`` | their elementwise-precision versions in :mod:`mxtrain.elementwise.modules` |

Every configuration of these torch modules is supported (groups, dilation, strides,
``output_padding``/``output_size``, string padding and every ``padding_mode`` of the
convs; ``affine=False``, ``track_running_stats=False``, ``momentum=None`` and
train/eval of the batch norms). Not supported, and skipped (listed in
``Conversion.skipped``) rather than converted: LayerNorm/RMSNorm over several
dimensions, and convolutions when the pinned recipe is an FP8 recipe
(``Float8Recipe``; a converted conv under an ambient FP8 recipe raises
``NotImplementedError``).

A replacement holds the very same ``Parameter`` and buffer objects as the module
it replaces (and its hooks, training flag and attributes), so the state dict,
optimizers built before or after, and weight updates are shared; the original
module objects are kept by the handle and put back by :meth:`Conversion.undo`
or :func:`unconvert`. With ``recipe=None`` the new modules follow the innermost
``mx_autocast`` (and are plain torch outside it); with a recipe they use it
always. This is the scoped, undoable form of microxcaling's ``inject_pyt_ops``,
which patches torch for the whole process.

``include`` / ``exclude`` select modules by qualified name (a glob such as
``"encoder.*"`` or ``"fc1"``), by type (``nn.Softmax``), or by a predicate
``f(name, module) -> bool``; a list means any of them.

The output layer of a language model stays in high precision unless
``keep_output_layer=False`` (see :func:`output_layers` and docs/fp4.md): it is
one small GEMM whose quantization error lands directly on the logits, and a
weight tied to the embedding would be quantized for the lookup's gradient too.
A module converted by an earlier ``convert`` is never converted twice: a call
that selects one raises, saying how to undo the first conversion.
"""

from __future__ import annotations

import fnmatch
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field

from torch import nn

from mxtrain.autocast import mx_autocast
from mxtrain.elementwise.modules import ELEMENTWISE_MODULES
from mxtrain.modules import LayerNorm, Linear, RMSNorm
from mxtrain.modules.batchnorm import BatchNorm1d, BatchNorm2d, BatchNorm3d
from mxtrain.modules.conv import (Conv1d, Conv2d, Conv3d, ConvTranspose1d, ConvTranspose2d, ConvTranspose3d,
                                  unsupported_recipe)
from mxtrain.modules.groupnorm import GroupNorm
from mxtrain.recipes import Recipe

__all__ = ["convert", "unconvert", "output_layers", "Conversion", "CONVERSIONS", "RECIPE_CHECKS"]


def _layernorm_ok(m):
    if len(m.normalized_shape) != 1:
        return f"normalizes {len(m.normalized_shape)} dims (mxtrain.LayerNorm: the last one only)"
    return None


def _rmsnorm_ok(m):
    if len(m.normalized_shape) != 1:
        return f"normalizes {len(m.normalized_shape)} dims (mxtrain.RMSNorm: the last one only)"
    return None


def _prepare_norm(new, old):
    new.__dict__["zero_centered_gamma"] = False
    if "bias" not in new._parameters:  # nn.RMSNorm has no bias; mxtrain's norms read self.bias
        new._parameters["bias"] = None
    if getattr(old, "eps", None) is None:  # nn.RMSNorm's eps=None means torch.finfo(dtype).eps
        import torch
        dtype = old.weight.dtype if getattr(old, "weight", None) is not None else torch.get_default_dtype()
        new.__dict__["eps"] = torch.finfo(dtype).eps


# torch type -> (replacement type, check returning a reason to skip or None, fix-up after copying attributes)
CONVERSIONS: dict = {
    nn.Linear: (Linear, None, None),
    nn.Conv1d: (Conv1d, None, None),
    nn.Conv2d: (Conv2d, None, None),
    nn.Conv3d: (Conv3d, None, None),
    nn.ConvTranspose1d: (ConvTranspose1d, None, None),
    nn.ConvTranspose2d: (ConvTranspose2d, None, None),
    nn.ConvTranspose3d: (ConvTranspose3d, None, None),
    nn.LayerNorm: (LayerNorm, _layernorm_ok, _prepare_norm),
    nn.GroupNorm: (GroupNorm, None, None),
    nn.BatchNorm1d: (BatchNorm1d, None, None),
    nn.BatchNorm2d: (BatchNorm2d, None, None),
    nn.BatchNorm3d: (BatchNorm3d, None, None),
}
# replacement type -> check(recipe) returning a reason not to convert under that pinned recipe, or None
RECIPE_CHECKS: dict = {cls: unsupported_recipe for cls in (Conv1d, Conv2d, Conv3d, ConvTranspose1d,
                                                            ConvTranspose2d, ConvTranspose3d)}
if hasattr(nn, "RMSNorm"):
    CONVERSIONS[nn.RMSNorm] = (RMSNorm, _rmsnorm_ok, _prepare_norm)
for _torch_type, _elementwise_type in ELEMENTWISE_MODULES.items():
    CONVERSIONS[_torch_type] = (_elementwise_type, None, None)


class _PinnedRecipe:
    """Runs ``forward`` under the recipe pinned by :func:`convert` (backward keeps it through autograd)."""

    def forward(self, *args, **kwargs):
        with mx_autocast(recipe=self.__dict__["_mx_recipe"]):
            return super().forward(*args, **kwargs)


_PINNED: dict[type, type] = {}


def _pinned(cls: type) -> type:
    """``cls`` running under a pinned recipe; a module-level class here, so converted models pickle."""
    if cls not in _PINNED:
        name = f"Pinned{cls.__name__}"
        if name in globals():
            name = f"Pinned{cls.__module__.rsplit('.', 1)[-1].title()}{cls.__name__}"
        pinned = type(name, (_PinnedRecipe, cls), {"__module__": __name__, "__qualname__": name,
                                                    "__doc__": cls.__doc__})
        globals()[name] = _PINNED[cls] = pinned
    return _PINNED[cls]


def _transplant(new_cls: type, old: nn.Module) -> nn.Module:
    """An instance of ``new_cls`` sharing ``old``'s parameters, buffers, children, hooks and attributes."""
    new = new_cls.__new__(new_cls)
    for k, v in old.__dict__.items():
        new.__dict__[k] = OrderedDict(v) if isinstance(v, OrderedDict) else (dict(v) if type(v) is dict else v)
    if hasattr(new, "_take_own_key"):  # a recipe-state module: old's key leads to old
        new._take_own_key()
    return new


# leaf names of vocabulary projections: Hugging Face (lm_head), GPT-NeoX (embed_out); "output" (Meta
# Llama, torchtitan) only at the root, where it cannot be an attention block's output projection
OUTPUT_LAYER_NAMES = ("lm_head", "embed_out")
ROOT_OUTPUT_LAYER_NAMES = ("output",)
# the torch type a replacement replaced, set in its __dict__ by convert(), so it survives pickling and
# deepcopy and a second convert() sees it (a converted module is no longer of a torch type, so it would be
# passed over silently)
_CONVERTED_MARK = "_mxtrain_converted"


def output_layers(model: nn.Module) -> dict[str, str]:
    """The ``nn.Linear`` layers of ``model`` that :func:`convert` keeps in high precision by default.

    ``{qualified name: why}`` for: a Linear whose weight is an ``nn.Embedding``'s weight
    (tied input and output embeddings); a Linear named ``lm_head`` or ``embed_out`` (any
    depth) or ``output`` (at the root); failing both, in a model holding an embedding,
    the last Linear that projects onto that embedding's vocabulary (``out_features ==
    num_embeddings``). A model without embeddings (an MLP, a CNN) has none.
    """
    embeddings = {name: m for name, m in model.named_modules() if isinstance(m, nn.Embedding)}
    tied = {id(m.weight): name for name, m in embeddings.items()}
    found: dict[str, str] = {}
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, m in linears:
        leaf = name.rsplit(".", 1)[-1]
        if id(m.weight) in tied:
            found[name] = f"its weight is tied to the embedding {tied[id(m.weight)]!r}"
        elif leaf in OUTPUT_LAYER_NAMES or name in ROOT_OUTPUT_LAYER_NAMES:
            found[name] = f"it is named {leaf!r}"
    if not found:
        vocab = {m.num_embeddings: name for name, m in embeddings.items()}
        heads = [(name, m) for name, m in linears if m.out_features in vocab]
        if heads:
            name, m = heads[-1]
            found[name] = f"it projects onto the vocabulary of the embedding {vocab[m.out_features]!r}"
    return found


def _matches(selector, name: str, module: nn.Module, original: type | None = None) -> bool:
    """``original``: the torch type a converted ``module`` replaced, which a type selector also matches."""
    if isinstance(selector, (list, tuple, set, frozenset)):
        return any(_matches(s, name, module, original) for s in selector)
    if isinstance(selector, str):
        return fnmatch.fnmatchcase(name, selector)
    if isinstance(selector, type):
        return isinstance(module, selector) or (original is not None and issubclass(original, selector))
    if callable(selector):
        return bool(selector(name, module))
    raise TypeError(f"include/exclude take names (glob patterns), module types or predicates f(name, module); "
                    f"got {type(selector).__name__} {selector!r}")


@dataclass
class Conversion:
    """What :func:`convert` did to a model; :meth:`undo` puts the original modules back.

    Attributes:
        replaced: ``[(qualified name, torch type name, new type name)]``.
        skipped: ``[(qualified name, reason)]`` for modules of a convertible type left alone.
        recipe: the pinned recipe, or None (the modules follow ``mx_autocast``).
    """

    model: nn.Module
    recipe: Recipe | None
    replaced: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    _swaps: list = field(default_factory=list, repr=False)  # (parent, attribute, original, replacement)
    undone: bool = False

    def undo(self) -> None:
        """Put the original modules back (idempotent)."""
        if self.undone:
            return
        for parent, attr, original, replacement in reversed(self._swaps):
            if parent._modules.get(attr) is replacement:
                parent._modules[attr] = original
            else:
                warnings.warn(f"mxtrain.convert: {type(parent).__name__}.{attr} was changed after conversion; "
                              "leaving it as it is", stacklevel=2)
        self.undone = True
        stack = self.model.__dict__.get("_mxtrain_conversions", [])
        if self in stack:
            stack.remove(self)

    def __enter__(self) -> "Conversion":
        return self

    def __exit__(self, *exc) -> bool:
        self.undo()
        return False

    def summary(self) -> str:
        lines = [f"converted {len(self.replaced)} module(s)"
                 + (f" with recipe {self.recipe!r}" if self.recipe is not None else " (following mx_autocast)")]
        lines += [f"  {name or '<root>'}: {old} -> {new}" for name, old, new in self.replaced]
        lines += [f"  skipped {name}: {why}" for name, why in self.skipped]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"Conversion(replaced={len(self.replaced)}, skipped={len(self.skipped)}, recipe={self.recipe!r}, "
                f"undone={self.undone})")


def convert(model: nn.Module, recipe: Recipe | None = None, *, include=None, exclude=None,
            keep_output_layer: bool = True) -> Conversion:
    """Replace, in place, the torch modules of ``model`` by their MX versions (see the module docstring).

    Args:
        model: any ``nn.Module``; its submodules are replaced (the root itself is not: wrap it).
        recipe: pin this recipe on the new modules; None: they follow ``mx_autocast``.
        include: only convert modules matching this (name glob, type, predicate or a list of them).
        exclude: leave modules matching this alone.
        keep_output_layer: True (default) leaves the output layer(s) found by :func:`output_layers`
            in high precision (listed in ``Conversion.skipped``); False converts them too.

    Returns:
        a :class:`Conversion`; ``.undo()`` (or ``mxtrain.unconvert(model)``, or leaving a
        ``with`` block) restores the original modules.

    Raises:
        ValueError: a selected module was already converted by an earlier ``convert``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert expects an nn.Module, got {type(model).__name__}")
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be an mxtrain recipe (MXFP8Recipe(), MXRecipe(...)...) or None, "
                        f"got {type(recipe).__name__}")
    if not isinstance(keep_output_layer, bool):
        raise TypeError(f"keep_output_layer must be True (leave the output layer in high precision) or False "
                        f"(convert it too), got {type(keep_output_layer).__name__} {keep_output_layer!r}")
    _refuse_converted(model, include, exclude)
    kept = output_layers(model) if keep_output_layer else {}
    handle = Conversion(model=model, recipe=recipe)
    done: dict[int, nn.Module] = {}  # a module shared by several parents is replaced once
    for parent_name, parent in list(model.named_modules(remove_duplicate=False)):
        for attr, child in list(parent._modules.items()):
            if child is None:
                continue
            name = f"{parent_name}.{attr}" if parent_name else attr
            entry = CONVERSIONS.get(type(child))
            if entry is None:
                continue
            if include is not None and not _matches(include, name, child):
                continue
            if exclude is not None and _matches(exclude, name, child):
                continue
            new = done.get(id(child))
            if new is None:
                new_cls, check, fixup = entry
                reason = check(child) if check else None
                if not reason and recipe is not None and new_cls in RECIPE_CHECKS:
                    reason = RECIPE_CHECKS[new_cls](recipe)
                if not reason and name in kept:
                    reason = (f"output layer kept in high precision ({kept[name]}); "
                              f"convert(..., keep_output_layer=False) converts it")
                if reason:
                    handle.skipped.append((name, reason))
                    continue
                new = _transplant(_pinned(new_cls) if recipe is not None else new_cls, child)
                new.__dict__[_CONVERTED_MARK] = type(child)
                if recipe is not None:
                    new.__dict__["_mx_recipe"] = recipe
                if fixup:
                    fixup(new, child)
                done[id(child)] = new
                handle.replaced.append((name, type(child).__name__, f"{new_cls.__module__}.{new_cls.__name__}"))
            parent._modules[attr] = new
            handle._swaps.append((parent, attr, child, new))
    model.__dict__.setdefault("_mxtrain_conversions", []).append(handle)
    return handle


def _refuse_converted(model: nn.Module, include, exclude) -> None:
    """Raise if ``include``/``exclude`` select a module an earlier :func:`convert` made (before anything changes)."""
    already = [name for name, m in model.named_modules()
               if m is not model and (original := m.__dict__.get(_CONVERTED_MARK)) is not None
               and (include is None or _matches(include, name, m, original))
               and (exclude is None or not _matches(exclude, name, m, original))]
    if not already:
        return
    shown = ", ".join(repr(n) for n in already[:4]) + (f" and {len(already) - 4} more" if len(already) > 4 else "")
    recipe = model.get_submodule(already[0]).__dict__.get("_mx_recipe")
    pinned = f"with {recipe!r}" if recipe is not None else "following mx_autocast"
    raise ValueError(f"mxtrain.convert: {len(already)} module(s) of this model are already converted ({shown}, "
                     f"{pinned}); converting them again would do nothing. Undo the earlier conversion first "
                     f"(handle.undo() or mxtrain.unconvert(model)) and convert again with the new recipe, or "
                     f"leave them out with exclude=/include=")


def unconvert(model: nn.Module) -> int:
    """Undo every :func:`convert` applied to ``model`` (latest first); returns how many were undone."""
    stack = model.__dict__.get("_mxtrain_conversions", [])
    n = 0
    while stack:
        stack[-1].undo()
        n += 1
    return n
