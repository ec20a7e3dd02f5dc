"""FSDP2 weight all-gathers that carry MX bytes (or FP8 codes) instead of bf16.

Users shard with torch's own ``fully_shard`` and launch with ``torchrun``;
:func:`enable_mx_all_gather` swaps the GEMM weights of mxtrain modules for
:class:`MXAllGatherWeight` *before* ``fully_shard``. That tensor subclass
implements FSDP2's all-gather extension (``fsdp_pre_all_gather`` /
``fsdp_post_all_gather``):

* The master weight stays sharded in high precision (what the optimizer updates).
* Before an all-gather each rank quantizes its shard with the recipe's weight
  role and sends codes and E8M0 scales packed in **one** uint8 buffer
  (MXFP8: 1 + 1/32 bytes per element instead of 2 for bf16).
* Only the plane the coming phase needs travels: rowwise (blocks along K, the
  fprop operand) before forward, columnwise (blocks along N, the dgrad operand)
  before backward. When one gather must serve both passes
  (``reshard_after_forward=False``, ``set_reshard_after_backward(False)``, or
  activation checkpointing, whose recomputed forward runs after the backward
  all-gather) both planes go at once.
* After the gather the planes are rebuilt exactly as quantizing the full weight
  would lay them out, and the module's ``Quantizer`` (mxtrain/modules/_quantizer.py)
  hands them to the GEMMs without quantizing again. A shard's blocks are the
  full weight's blocks, so the bytes are identical to single-process MX training.
  On GPUs whose MX GEMM multiplies bf16 values (Hopper, see mxtrain/kernels/gemm.py)
  with bf16 params, each rank's codes are dequantized straight from the gather
  buffer into the full weight's bf16 values instead (:data:`GATHER_VALUES`): the
  values of quantizing the full weight, bit for bit, with no copy of the codes
  and no dequantize pass before each GEMM.
* Outside ``mx_autocast`` (and for roles that must see high precision: a role
  with no format, stochastic rounding) the gather sends the high-precision shard.
* Gradients (reduce-scatter) stay in high precision; nothing changes there.
* FP8 recipes (Float8CurrentScaling, DelayedScaling, Float8BlockScaling) send FP8
  codes only, 1 byte per element: every rank makes the same scale(s) from one batched
  amax all-reduce per FSDP group (per tensor, or per 128 x 128 block) or, for delayed
  scaling, from the module's state; the dgrad plane is the transpose of the gathered
  codes (see ``_fp8_input`` and ``_GatheredState._fill_fp8``).

The recipe is read with :func:`mxtrain.get_recipe` when the forward all-gather
runs (FSDP's pre-forward hook runs inside the caller's ``mx_autocast``) and is
remembered on the weight, because the backward all-gather runs outside it.

Private FSDP2 attributes used (checked on torch 2.11-2.13): the FSDP state
registry (``torch.distributed._composable_state._module_state_mapping``),
``FSDPState._fsdp_param_groups``, ``FSDPParamGroup._training_state`` /
``_reshard_after_forward`` / ``reshard_after_backward`` / ``fsdp_params``,
``FSDPParam._orig_size`` / ``mesh_info.shard_process_group`` (FP8 amax all-reduces), and
``FSDPParam.all_gather_outputs`` (reset when the size of what a weight sends
changes, e.g. MX in training then high precision in an evaluation outside
``mx_autocast``); for CUDA-graphed steps (``ReplayBookkeeping``),
``FSDPParamGroup.is_unsharded`` / ``reshard()`` and ``FSDPParam.sharded_param``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from mxtrain import config
from mxtrain.recipes import MXRecipeBase, RoleSpec
from mxtrain.recipes.float8 import BLOCK_LEN, Float8Recipe, Float8RoleSpec
from mxtrain.autocast import get_recipe
from mxtrain.formats import parse_format
from mxtrain.kernels.cuda_cast import cast_planes_into
from mxtrain.kernels.dispatch import quantize
from mxtrain.kernels.shard_cast import shard_amaxes, shard_codes
from mxtrain.kernels.transpose import transpose_bytes, transpose_bytes_many
from mxtrain.quantization import MXTensor
from mxtrain.quantization.float8 import (
    FP8_DTYPES, FP8_MAX, Float8Plane, Float8Tensor, all_reduce_amax, cast_to_fp8, compute_scale,
)
from mxtrain.quantization.mxtensor import MXPlane

__all__ = [
    "MXAllGatherWeight", "MXGatheredWeight", "enable_quantized_all_gather", "enable_mx_all_gather",
    "disable_mx_all_gather",
    "mx_weight_names", "all_gather_stats", "reset_all_gather_stats", "check_mx_all_gather_shapes",
]

aten = torch.ops.aten

FPROP = ("fprop_weight", 1)  # rowwise: blocks along K (dim 1)
DGRAD = ("dgrad_weight", 0)  # columnwise: blocks along N (dim 0, the dim FSDP shards)


def mx_weight_names(module: nn.Module) -> tuple[str, ...]:
    """Names of the GEMM weights of an mxtrain module (empty for any other module): what its class
    declares in ``quantized_all_gather_weights`` (read from the class, so that wrappers which forward
    attribute reads to an inner module, such as torch.compile's, are not taken for it)."""
    return tuple(getattr(type(module), "quantized_all_gather_weights", ()))


# --------------------------------------------------------------------------- stats

@dataclass
class _Stats:
    gathers: int = 0
    mx_gathers: int = 0
    fp8_gathers: int = 0
    bytes_sent: int = 0  # per rank, summed over gathers (what this rank contributes)
    elements: int = 0  # weight elements those gathers covered (per rank)
    amax_reductions: int = 0  # FP8 gathers: batched all-reduces of weight amaxes
    amax_bytes: int = 0  # what this rank put into them
    planes: dict = field(default_factory=dict)  # "rowwise"/"columnwise"/"both"/"high_precision" -> count
    resent: int = 0  # gathers that sent what the weight's forward gather sent (no cast: see _SentShard)
    transposes: int = 0  # FP8 dgrad planes made by transposing gathered codes
    batched: int = 0  # FP8 gathers that sent codes made by the step's batched cast (_batched_casts)
    batched_transposes: int = 0  # of transposes: those made in a group's one launch (_batch_transposes)


_STATS = _Stats()


def all_gather_stats() -> dict:
    """What this process's quantized-weight all-gathers sent so far (bytes are this rank's contribution).

    ``bytes_per_element`` counts the all-gathers; ``wire_bytes_per_element`` adds the FP8
    recipes' amax all-reduces."""
    s = dataclasses.asdict(_STATS)
    s["bytes_per_element"] = s["bytes_sent"] / s["elements"] if s["elements"] else float("nan")
    s["wire_bytes_per_element"] = ((s["bytes_sent"] + s["amax_bytes"]) / s["elements"] if s["elements"]
                                   else float("nan"))
    return s


def reset_all_gather_stats() -> None:
    global _STATS
    _STATS = _Stats()


# --------------------------------------------------------------------------- FSDP internals

@functools.cache
def _fsdp_training_state_enum():
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    return TrainingState


def _param_groups(state) -> list:
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch <= 2.11 kept a single group
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return list(groups)


def _find_fsdp_param(local: torch.Tensor):
    """The (FSDPParam, FSDPParamGroup) whose sharded local tensor is ``local`` (cached on it)."""
    cached = getattr(local, "_mx_fsdp_refs", None)
    if cached is not None:
        fsdp_param, group = cached[0](), cached[1]()
        if fsdp_param is not None and group is not None and fsdp_param._sharded_local_tensor is local:
            return fsdp_param, group
    for group in _live_param_groups():
        for fsdp_param in group.fsdp_params:
            if fsdp_param._sharded_local_tensor is local:
                local._mx_fsdp_refs = (weakref.ref(fsdp_param), weakref.ref(group))
                return fsdp_param, group
    raise RuntimeError(
        "mxtrain MX all-gather: FSDP2 called fsdp_pre_all_gather on a weight it does not seem to manage "
        f"(torch {torch.__version__}); this torch version's FSDP2 internals are not supported")


def _peer_groups(group, pg) -> list:
    """``group`` first, then every other FSDP parameter group of the same FSDP tree (the model ``fully_shard``
    wrapped: its root's state list, the same on every rank) whose parameters shard over ``pg``. Not every
    live FSDP state: another model's, or one not yet collected, may exist on one rank only. Cached on the
    group (weakly: a group does not keep its peers alive)."""
    cached = getattr(group, "_mxtrain_peers", None)
    if cached is not None and cached[0] is pg:
        peers = [ref() for ref in cached[1]]
        if all(p is not None for p in peers):
            return [group, *peers]
    from torch.distributed._composable_state import _get_module_state

    state = _get_module_state(group.modules[0]) if getattr(group, "modules", None) else None
    ctx = getattr(state, "_state_ctx", None)
    states = list(getattr(ctx, "all_states", ()) or ())
    if not any(g is group for st in states for g in _param_groups(st)):
        return [group]  # not (yet) under an initialized root: this group alone
    peers = []
    for st in states:
        for g in _param_groups(st):
            if g is not group and any(isinstance(fp._sharded_local_tensor, MXAllGatherWeight)
                                      and fp.mesh_info.shard_process_group is pg for fp in g.fsdp_params):
                peers.append(g)
    group._mxtrain_peers = (pg, [weakref.ref(g) for g in peers])
    return [group, *peers]


def _triton_float8_casts(device: torch.device, dtype: torch.dtype):
    """``(tensor_cast_float8, block_cast_float8)`` where FP8 casts of ``dtype`` data on ``device`` run on the
    Triton backend (wherever a ``float8_quantize`` call may reach Triton's kernel: on CUDA, or with
    MXTRAIN_BACKEND=triton under the interpreter), else None (the reference ops). The pre-all-gather
    calls the kernels itself: the per-tensor cast takes the all-reduced amax (scale and scale_inv made in the
    kernel, as ``compute_scale`` and ``reciprocal`` make them) and skips the local amax pass that
    ``quantize_float8`` would make."""
    return _triton_float8_casts_for(device, dtype, config.current().backend)


@functools.cache
def _triton_float8_casts_for(device: torch.device, dtype: torch.dtype, backend: str):
    # cached per backend setting: resolving costs tens of microseconds, and every FP8 gather asks
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    from mxtrain.kernels import registry

    try:
        # the casts that take a given amax are Triton's (the CUDA block cast is reached through them): they run
        # where a float8_quantize call may reach Triton, as the modules' fused casts do (Quantizer.quantize_fused)
        if not registry.walks("float8_quantize", device, "triton"):
            return None
        from mxtrain.kernels.float8_cast import block_cast_float8, tensor_cast_float8
    except (ImportError, RuntimeError):
        return None
    return tensor_cast_float8, block_cast_float8


def _batched_casts(device: torch.device) -> bool:
    """Whether the FP8 gathers' per-tensor, current-scaled amaxes and casts run batched: every FP8-gathered
    weight of the step at once, at the step's first FP8 gather (``mxtrain.kernels.shard_cast``: one launch for
    the amaxes and one for the codes on CUDA; the reference, per weight, elsewhere unless the Triton interpreter
    runs them). MXTRAIN_FSDP_BATCHED_CASTS: ``auto`` on CUDA (a cast per weight and gather cost the host about
    0.2 ms there, more than the GPU took), ``1`` anywhere, ``0`` never. Never while dynamo traces the hooks (a
    compiled FSDP2 step traces them itself)."""
    mode = config.current().fsdp_batched_casts
    if mode == "0" or torch.compiler.is_compiling():
        return False
    return mode == "1" or device.type == "cuda"


def _batchable(shards: list, param_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``shard_amaxes`` / ``shard_codes`` serve these shards: batching on for ``device``, every shard a
    non-empty, contiguous 2-D tensor there, all of one dtype, ``param_dtype`` or fp32 to be rounded to bf16 (others,
    fp32 masters of fp16 params, cast per weight)."""
    return bool(shards) and _batched_casts(device) and all(
        d.dim() == 2 and d.numel() and d.is_contiguous() and d.device == device and d.dtype == shards[0].dtype
        and (d.dtype == param_dtype or (d.dtype == torch.float32 and param_dtype == torch.bfloat16))
        for d in shards)


def _first_line(e: Exception) -> str:
    """An error as a warning names it: its type and the first line of its message (200 characters at most)."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


_BATCH_FAILED: list = []  # the first error of a batched cast in this process (then the casts go per weight)


def _batched_call(fn, *args):
    """``fn(*args)`` (``shard_amaxes`` / ``shard_codes``: one launch for every shard on CUDA), or None where
    batching failed: if it raises (a kernel that does not build here), a warning says so once and every later
    batch returns None too, so the gathers cast per weight (the same bits). Each rank decides alone, and the
    collectives do not depend on it. Running out of memory raises as any cast would, and so do arguments the casts
    refuse (ValueError, TypeError: a caller's bug, not a kernel's)."""
    if _BATCH_FAILED:
        return None
    try:
        return fn(*args)
    except (torch.OutOfMemoryError, ValueError, TypeError):  # (out of memory, or arguments the casts refuse: a bug)
        raise
    except Exception as e:  # noqa: BLE001 (a kernel that fails to build or launch; the per-weight casts remain)
        _BATCH_FAILED.append(_first_line(e))
        warnings.warn(f"mxtrain FP8 all-gather: the batched casts failed ({_BATCH_FAILED[0]}); each weight is cast "
                      "in its own gather from now on (MXTRAIN_FSDP_BATCHED_CASTS=0 does so from the start)",
                      RuntimeWarning, stacklevel=2)
        return None


_TRANSPOSES_FAILED: list = []  # the first error of a group's one-launch transposes (then each fill transposes)


def _dgrad_job(buf: torch.Tensor, meta: dict, state) -> tuple | None:
    """``(codes [N, K], dgrad arena [K, N])`` as bytes, where this FP8 gather's fill transposes (a dgrad plane that
    is not left to a later gather, into an arena of the right size); else None."""
    if meta.get("kind") != "fp8" or 0 not in meta["specs"] or meta.get("dgrad_later") or buf.dtype != torch.uint8:
        return None
    n, k = meta["shape"]
    arena = state.inner[0] if state.inner else None
    if arena is None or not n * k or arena.numel() != n * k or buf.numel() < n * k:
        return None
    return buf.view(-1, k)[:n], arena


def _batch_transposes(weight, buf: torch.Tensor, meta: dict, state) -> None:
    """At the first FP8 weight of an FSDP group to be filled after a gather, the dgrad planes of every weight of
    the group that gather brought, in one launch for up to four (``transpose_bytes_many``): one weight at a time,
    each transpose cost the host 27 us alone and about 80 us inside an FSDP2 step on an H100 host (a backward
    all-gather of a Llama layer brings four). FSDP2 has copied every output of the group's all-gather out before
    it fills the first; a later weight's arena is allocated here (FSDP2's allocation before its fill then finds it
    allocated), and its fill finds ``state.transposed`` set to the metadata it is given, and skips its transpose.
    Only where ``_batched_casts`` holds; one weight alone transposes in its fill. If the launch fails (a kernel
    that does not build here), a warning says so once and every fill transposes its own from then on."""
    mine = _dgrad_job(buf, meta, state)  # (first: a forward gather that leaves its dgrad plane returns here)
    if mine is None or _TRANSPOSES_FAILED or not _batched_casts(buf.device):
        return
    fsdp_param, group = _find_fsdp_param(weight)
    jobs, marks = [mine], []
    for fp in group.fsdp_params:
        other = getattr(fp, "_unsharded_param", None)
        extensions = getattr(fp, "_extensions_data", None)
        m = getattr(extensions, "all_gather_metadata", None)
        if (fp is fsdp_param or not isinstance(fp._sharded_local_tensor, MXAllGatherWeight)
                or not isinstance(other, MXGatheredWeight) or not isinstance(m, dict)
                or len(fp.all_gather_outputs) != 1 or other._state.transposed is m):
            continue
        job = _dgrad_job(fp.all_gather_outputs[0], m, other._state)
        if job is not None:
            jobs.append(job)
            marks.append((other._state, m))
    if not marks:
        return  # this weight alone: its fill transposes
    arenas = [arena for _, arena in jobs]
    for arena in arenas[1:]:  # as FSDP2's alloc_storage before each fill
        size = arena.numel() * arena.element_size()
        if arena.untyped_storage().size() != size:
            arena.untyped_storage().resize_(size)
    try:
        with contextlib.ExitStack() as stack:
            for arena in arenas:  # the arenas a traced backward saved: written as a gather writes them (see fill)
                stack.enter_context(torch.autograd._unsafe_preserve_version_counter(arena))
            transpose_bytes_many([r for r, _ in jobs],
                                 [a.view(torch.uint8).view(r.shape[1], r.shape[0]) for r, a in jobs])
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # noqa: BLE001 (a kernel that fails to build or launch: each fill transposes its own)
        _TRANSPOSES_FAILED.append(_first_line(e))
        warnings.warn(f"mxtrain FP8 all-gather: a group's dgrad planes could not be transposed in one launch "
                      f"({_TRANSPOSES_FAILED[0]}); each weight's fill transposes its own from now on",
                      RuntimeWarning, stacklevel=2)
        return
    state.transposed = meta
    for st, m in marks:
        st.transposed = m
    _STATS.transposes += len(jobs)
    _STATS.batched_transposes += len(jobs)


def _amax_key(spec, param_dtype: torch.dtype) -> tuple:
    """What an FP8 amax all-reduce's results depend on besides the weights (``_fp8_scales``, ``_fp8_cached``)."""
    return (spec.block, param_dtype, spec.fmt, spec.scaling, spec.power_of_2_scales, spec.amax_epsilon)


def _rebatch_codes(group, pg, spec, param_dtype: torch.dtype, device: torch.device) -> None:
    """A forward gather that finds no batched codes for its weight while the step's scales still hold (a later
    micro-batch of gradient accumulation, an evaluation forward after training, a second forward): the codes of
    every peer group's members whose scales still hold, at those scales, in one batched cast (no amax pass, no
    all-reduce), as ``_fp8_scales`` makes them. Members whose weights changed are left to their own gathers.
    Only where every peer group has sent its codes (a new forward); a group gathered twice in one forward (a
    module called twice) casts its own members only, so the codes other groups have not sent yet stay."""
    key = _amax_key(spec, param_dtype)
    peers = _peer_groups(group, pg)
    if any(getattr(g, "_mxtrain_fp8_codes", None) for g in peers):
        peers = [group]
    jobs = []  # (group, FSDPParam, data, scale)
    for g in peers:
        hit = _amax_hit(g, key)
        if hit is None:
            continue
        jobs.extend((g, fp, d, res[1]) for (fp, _, d, _), res in zip(hit[1], hit[2]))
    datas = [d for _, _, d, _ in jobs]
    if not jobs or any(sc is None for *_, sc in jobs) or not _batchable(datas, param_dtype, device):
        return
    codes = _batched_call(shard_codes, datas, torch.stack([sc for *_, sc in jobs]).float(), param_dtype,
                          spec.fmt)
    if codes is None:
        return
    made: dict = {}
    for (g, fp, d, _), c in zip(jobs, codes):
        made.setdefault(g, {})[fp] = (c, d, d._version)
    for g, entries in made.items():
        g._mxtrain_fp8_codes = entries


def _take_codes(group, fsdp_param, data: torch.Tensor):
    """The FP8 codes the step's batched cast made for ``fsdp_param`` from ``data`` as it is now, once (the
    gather that sends them keeps them as long as it needs); None where there are none. The batch ran on the
    stream of the step's first gather (FSDP2's copy-in stream; the current one for a user's ``unshard()``):
    the codes are marked as used on this gather's stream, so the allocator does not hand their memory out
    before this gather's copy-in has read them."""
    made = getattr(group, "_mxtrain_fp8_codes", None)
    entry = made.pop(fsdp_param, None) if made else None
    if entry is None or entry[1] is not data or data._version != entry[2]:
        return None
    codes = entry[0]
    if codes.is_cuda:
        codes.record_stream(torch.cuda.current_stream(codes.device))
    return codes


# --------------------------------------------------------------------------- the sharded master weight

@dataclass
class _WeightInfo:
    """Shared by a weight and every view FSDP makes of it."""

    name: str
    activation_checkpointing: bool = False
    gemm: str = ""  # LayerNormMLP's "fc1" / "fc2": the GEMM whose DelayedScaling slots the weight uses
    recipe: Any = None  # the recipe of the last forward all-gather (backward reuses it)
    recipe_seen: bool = False
    # traced by torch.compile: every gather lays out both planes in one place, so that the backward's gather refills,
    # in place, the buffers whose views the traced forward saved for its backward (MX forward gathers send the
    # rowwise plane only once a gather of both laid them out; see MXGatheredWeight.mx_traced_weight); None until
    # the first gather looks at the FSDP group
    traced: bool | None = None
    # DelayedScaling: (state, slot, its eager update count, the weight data's version, scale) of the last gather's
    # cast; a later gather of the unchanged weight at the same update count (backward's) casts at that scale
    delayed_cast: Any = None
    # MX, traced: the layout key (_mx_layout_key) under which the gathered weight holds both planes in fixed places
    # (a gather that sent both laid them out), or None; a forward gather then sends the rowwise plane only
    mx_layout: Any = None


# Ops whose results stay MXAllGatherWeight: what FSDP2 does to build and pad the
# sharded local tensor (new_zeros, narrow/slice, view, split/chunk, copy_), moving it
# (_to_copy, _pin_memory), and detach/alias/clone. Everything else (optimizer math,
# zeros_like for optimizer state) returns plain tensors.
_PRESERVE = {
    aten.detach.default, aten.alias.default, aten.empty_like.default, aten.new_zeros.default,
    aten.new_empty.default, aten.slice.Tensor, aten.narrow.default, aten.view.default,
    aten._unsafe_view.default, aten.as_strided.default, aten._to_copy.default, aten._pin_memory.default,
    aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.clone.default,
}


_MUTATES_FIRST_ARG: dict = {}


def _map_flat(cls, fn, args, kwargs):
    """``pytree.tree_map_only(cls, fn, (args, kwargs))`` for what aten ops take: tensors, scalars and
    one level of lists / tuples (``Tensor[]``). Walking pytree costs tens of microseconds per op, and the
    optimizer sends a few ops per weight and step through ``__torch_dispatch__``; anything nested deeper
    (or a dict) goes to pytree as before."""
    def one(a):
        if isinstance(a, cls):
            return fn(a)
        if type(a) in (list, tuple):
            if not any(isinstance(t, (cls, list, tuple, dict)) for t in a):
                return a
            if any(isinstance(t, (list, tuple, dict)) and type(t) is not torch.Size for t in a):
                raise _Nested
            return type(a)(fn(t) if isinstance(t, cls) else t for t in a)
        if isinstance(a, (list, tuple, dict)) and type(a) is not torch.Size:  # a namedtuple, a dict: pytree's
            raise _Nested
        return a

    try:
        return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}
    except _Nested:
        return pytree.tree_map_only(cls, fn, (tuple(args), kwargs))


class _Nested(Exception):
    pass


def _mutates_first_arg(func) -> bool:
    return _written_args(func)[0]


def _written_args(func) -> tuple:
    """``(whether the op writes its first argument, ((position, name) of every argument it writes)))``."""
    m = _MUTATES_FIRST_ARG.get(func)
    if m is None:  # reading an op's schema costs microseconds; the optimizer sends a few ops per weight per step
        args = func._schema.arguments
        written = tuple((i, a.name) for i, a in enumerate(args) if a.alias_info is not None and a.alias_info.is_write)
        m = _MUTATES_FIRST_ARG[func] = (bool(written) and written[0][0] == 0, written)
    return m


def _bump_written(cls, func, args, kwargs) -> None:
    # An op on the wrapper runs on ``_data`` below autograd, where in-place ops leave the version counter
    # alone; the FP8 amax reuse (``_fp8_cached``) reads ``_data._version``, so count the write here.
    for i, name in _written_args(func)[1]:
        a = args[i] if i < len(args) else kwargs.get(name)
        if isinstance(a, cls):
            torch.autograd.graph.increment_version(a._data)
        elif isinstance(a, (list, tuple)):
            datas = [t._data for t in a if isinstance(t, cls)]
            if datas:
                torch.autograd.graph.increment_version(datas)


def _fp8_cached(group, key, fsdp_param):
    """The ``(amax, scale, scale_inv)`` the group's last FP8 amax all-reduce made for ``fsdp_param``, if it
    still holds: the same key (spec fields and param dtype) and, for **every** member of the group, the same
    sharded tensor, data tensor and data version (``_version``: any in-place write bumps it, an optimizer
    step, ``copy_`` from a checkpoint, an edit under ``no_grad``). Else None: the caller all-reduces anew.

    Every rank must decide alike, or one would all-reduce while the other all-gathers (a hang). The
    decision reads only what every rank has alike: the key comes from the recipe, which every rank runs;
    the members are the group's parameters, in FSDP's order on every rank; and a version moves with the
    writes to a parameter, which every rank makes to its own shard of it (the same optimizer step, load or
    edit of the whole parameter; an in-place op bumps the version even on an empty shard). Checking every
    member, not just the one gathered, keeps a group's weights on one decision. Writing to one rank's shard
    alone (outside the DTensor) breaks that, as it breaks FSDP training anyway."""
    hit = _amax_hit(group, key)
    if hit is None:
        return None
    return next((res for (fp, *_), res in zip(hit[1], hit[2]) if fp is fsdp_param), None)


def _amax_hit(group, key):
    """The group's last FP8 amax results, ``(key, seen, results)``, where they still hold for **every** member
    (the same key, sharded tensor, data tensor and data version: see ``_fp8_cached``); else None."""
    hit = getattr(group, "_mxtrain_fp8_amax", None)
    if hit is None or hit[0] != key:
        return None
    for fp, w, data, version in hit[1]:
        if fp._sharded_local_tensor is not w or w._data is not data or data._version != version:
            return None
    return hit


def _layout_key(row_spec, col_spec, param_dtype, world: int, values: bool) -> tuple:
    """What fixes where a traced MX weight's two planes lie in its gathered buffer (``_GatheredState._place``): the
    two weight roles' specs, the param dtype, the world size and whether the planes arrive as values. A forward
    gather sends one plane only into a layout made under the same key (the same on every rank)."""
    return (row_spec, 1), (col_spec, 0), param_dtype, world, values


def _mx_layout_key(recipe, param_dtype, world: int, device) -> tuple:
    """:func:`_layout_key` of the layout a gather under ``recipe`` makes."""
    return _layout_key(recipe.role(FPROP[0]), recipe.role(DGRAD[0]), param_dtype, world,
                       _gather_values(device, param_dtype))


class _SentShard:
    """The FP8 codes a forward all-gather of a weight sent (with their scale_inv and amax), kept for the backward
    gather that FSDP makes after resharding: that gather sends the same bytes when they come from the same cast
    (``key``) at the same scales (``refs``: the objects the scales came from, compared by identity) of the
    weight's unchanged data (the same tensor at the same version: an optimizer step, a checkpoint load or an edit
    under ``no_grad`` bumps it). Used once; a rank's own decision (nothing goes over the wire differently).
    Costs one shard's codes per weight (1 byte per element / world size) from forward to backward."""

    __slots__ = ("data", "version", "key", "refs", "codes", "scale_inv", "amax")

    def __init__(self, data, key, refs, codes, scale_inv, amax):
        self.data, self.version, self.key, self.refs = data, data._version, key, refs
        self.codes, self.scale_inv, self.amax = codes, scale_inv, amax

    def holds(self, data, key, refs) -> bool:
        return (self.data is data and self.version == data._version and self.key == key
                and len(self.refs) == len(refs) and all(a is b for a, b in zip(self.refs, refs)))


class MXAllGatherWeight(torch.Tensor):
    """A high-precision weight (a plain tensor inside) whose FSDP2 all-gathers send MX bytes.

    It behaves as the tensor it wraps for every op (optimizer updates, state-dict
    copies, clipping); FSDP2's sharding keeps the subclass on the local shard.
    ``fsdp_pre_all_gather`` quantizes the shard; ``fsdp_post_all_gather``
    rebuilds an :class:`MXGatheredWeight` holding the full MX planes.
    """

    _data: torch.Tensor
    _info: _WeightInfo

    @staticmethod
    def __new__(cls, data: torch.Tensor, info: _WeightInfo):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(), dtype=data.dtype,
            layout=data.layout, device=data.device, requires_grad=data.requires_grad)

    def __init__(self, data: torch.Tensor, info: _WeightInfo):
        self._data = data
        self._info = info

    def __repr__(self) -> str:
        return f"MXAllGatherWeight(name={self._info.name!r}, data={self._data!r})"

    def __tensor_flatten__(self):
        return ["_data"], self._info

    @staticmethod
    def __tensor_unflatten__(inner, info, outer_size, outer_stride):
        return MXAllGatherWeight(inner["_data"], info)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        info = None

        def unwrap(t):
            nonlocal info
            info = info or t._info
            return t._data

        plain_args, plain_kwargs = _map_flat(cls, unwrap, args, kwargs)
        out = func(*plain_args, **plain_kwargs)
        mutates_first, written = _written_args(func)
        if written:
            _bump_written(cls, func, args, kwargs)
        if args and isinstance(args[0], cls) and mutates_first:
            return args[0]
        if func in _PRESERVE:
            return pytree.tree_map_only(torch.Tensor, lambda t: cls(t, info), out)
        return out

    # ---- what a module's Quantizer asks a weight (mxtrain/modules/_quantizer.py)

    def mx_gathered_plane(self, spec, axis: int) -> None:
        return None  # not all-gathered (used without FSDP): the module quantizes the weight itself

    def mx_keep_dgrad_plane(self, spec) -> bool:
        return True  # as any weight that is not all-gathered

    def high_precision(self) -> torch.Tensor:
        return self._data

    # ---- FSDP2 all-gather extension

    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        TrainingState = _fsdp_training_state_enum()
        fsdp_param, group = _find_fsdp_param(self)
        param_dtype = mp_policy.param_dtype or self.dtype
        cached = getattr(self, "_mx_mesh_size", None)
        if cached is None or cached[0] is not mesh:  # DeviceMesh.size() walks its layout: ask once per mesh
            cached = self._mx_mesh_size = (mesh, mesh.size())
        world = cached[1]
        phase = group._training_state
        info = self._info
        if phase == TrainingState.FORWARD:
            recipe = get_recipe()
            info.recipe, info.recipe_seen = recipe, True
        elif phase == TrainingState.PRE_BACKWARD or info.recipe_seen:
            recipe = info.recipe
        else:  # an unshard outside forward/backward (user-called unshard) before any forward
            recipe = get_recipe()

        if info.traced is None:
            info.traced = _compiled_group(group)
        fp8_recipe = recipe is not None and isinstance(recipe.role("fprop_weight"), Float8RoleSpec)
        # A forward gather that FSDP follows with a backward gather of the same weight (resharded after forward;
        # not a forward recomputed inside backward, whose group is not gathered again before its backward)
        again = (phase == TrainingState.FORWARD and group._reshard_after_forward
                 and torch._C._current_graph_task_id() == -1)  # (-1: no backward running on this thread)
        # MX, traced: a forward gather that FSDP follows with a backward gather, into a layout of both planes made
        # under this recipe
        one_plane = (again and not fp8_recipe and recipe is not None
                     and info.mx_layout == _mx_layout_key(recipe, param_dtype, world, self.device))
        if info.traced and phase in (TrainingState.FORWARD, TrainingState.PRE_BACKWARD) and not one_plane:
            # a traced weight's gathered planes all exist in every gather (FP8: the same codes serve both). MX: the
            # backward's gather sends both (a recompute inside the compiled backward may read the rowwise one);
            # a forward gather followed by that one sends the rowwise plane only, into the place a gather of both
            # laid out (the compiled forward only saves the columnwise one: the backward's gather writes it)
            roles = [FPROP, DGRAD]
        elif phase == TrainingState.FORWARD:
            # One gather must also serve backward when the weight is not resharded in between.
            # (FSDP gathers under no_grad, so the caller's grad mode is not visible here; only
            # inference_mode, which no_grad leaves on, says that no backward will follow.)
            both = (not group._reshard_after_forward) and not torch.is_inference_mode_enabled()
            roles = [FPROP, DGRAD] if both else [FPROP]
        elif phase == TrainingState.PRE_BACKWARD:
            # the recomputed forward (activation checkpointing) and the next forward without a
            # reshard after backward need the rowwise plane too
            both = info.activation_checkpointing or not getattr(group, "reshard_after_backward", True)
            roles = [DGRAD, FPROP] if both else [DGRAD]
        else:
            roles = [FPROP, DGRAD]
        # A forward gather whose weight FSDP reshards after forward is gathered again before backward, unchanged
        # unless the weight was written in between: keep the FP8 codes it sends, and let that gather send them
        # again when they are cast at the same scales (no second cast; see _SentShard). (Not MX planes: they
        # differ by pass, or, for a traced weight, take 2 bytes per element to keep, for one launch saved.)
        sent, self._mx_sent = getattr(self, "_mx_sent", None), None
        if phase != TrainingState.PRE_BACKWARD:
            sent = None
        keep = again and not torch.is_inference_mode_enabled()
        uses = fp8 = None
        if fp8_recipe:
            fp8 = self._fp8_uses(recipe, roles, phase, group, module)
        elif recipe is not None:
            uses = [(recipe.role(role), axis) for role, axis in roles]
            if any(not isinstance(spec, RoleSpec) or spec.fmt is None or spec.rounding == "stochastic"
                   for spec, _ in uses):
                # the module needs the high-precision weight (unquantized role, or a recipe this
                # all-gather does not know) or quantizes it itself (stochastic rounding: the draws
                # for the full weight cannot be split by shard)
                uses = None

        if fp8 is not None:
            # a forward gather outside backward (not a recompute): where the step's batched codes are spent, it may
            # batch anew (_rebatch_codes)
            fresh = phase == TrainingState.FORWARD and torch._C._current_graph_task_id() == -1
            inputs, meta = self._fp8_input(fp8, fsdp_param, group, orig_size, world, param_dtype, sent, keep, fresh)
        elif uses is None:
            inputs, meta = self._high_precision_input(orig_size, world, param_dtype)
        else:
            inputs, meta = self._mx_input(uses, orig_size, world, param_dtype)
        # a forward gather whose planes serve backward (not gathered again, or gathered again with the same layout
        # into the same buffers): a traced module may save them for its backward
        meta["kept"] = phase == TrainingState.FORWARD and (info.traced or len(roles) > 1)
        # FP8: the dgrad plane of a traced forward gather is written by the backward gather before any use (the
        # traced forward only saves it): the transpose waits for that gather
        meta["dgrad_later"] = again and bool(info.traced)
        # FP8 per-tensor current scaling, traced: the compiled graph transposes the gathered rowwise codes for the dgrad
        # plane itself (mx_gathered_plane: inductor's kernel, launched from its code; the partitioner places it), so
        # the fill leaves the plane out: no transpose launched from Python (about 250 us of host a group on an H100
        # host). A forward gather that a backward gather follows keeps nothing for it: the backward reads the codes
        # the forward saw, refilled in place by the backward gather (as FSDP2 refills a plain parameter). A module of
        # the group that runs eagerly (a graph break) transposes each weight in its backward. DelayedScaling weights
        # and the modules of a recipe with an amax_reduction_group run eagerly (their casts cannot be compiled), and
        # block scaling keeps the plane: their fills transpose, in one launch a group.
        if (meta["kind"] == "fp8" and bool(info.traced) and meta["block"] is None
                and phase in (TrainingState.FORWARD, TrainingState.PRE_BACKWARD)
                and 0 in meta["specs"] and meta["specs"][0].scaling != "delayed"
                and getattr(recipe, "amax_reduction_group", None) is None):
            meta["specs"] = {a: spec for a, spec in meta["specs"].items() if a != 0}  # the fill makes the rowwise one
        # MX: a traced weight's planes stay in their places (_PlaneLayout); a gather that sends one writes it there
        meta["in_place"] = bool(info.traced) and meta["kind"] == "mx"
        layout = (inputs[0].numel(), inputs[0].dtype)
        outputs = fsdp_param.all_gather_outputs
        if outputs and (outputs[0].numel() != layout[0] * world or outputs[0].dtype != layout[1]):
            # FSDP2 sizes its all-gather outputs at the first gather; this gather sends a
            # different layout (other planes or high precision), so let it size them again
            fsdp_param.all_gather_outputs = []
        _STATS.gathers += 1
        _STATS.mx_gathers += meta["kind"] == "mx"
        _STATS.fp8_gathers += meta["kind"] == "fp8"
        _STATS.bytes_sent += inputs[0].numel() * inputs[0].element_size()
        _STATS.elements += self.numel()
        _STATS.planes[meta["what"]] = _STATS.planes.get(meta["what"], 0) + 1
        return inputs, meta

    # FSDP2 reads this hook's signature on every gather (inspect.signature, tens of microseconds a call);
    # a stored __signature__ is what inspect returns without building it again
    fsdp_pre_all_gather.__signature__ = inspect.signature(fsdp_pre_all_gather)

    def _local_rows(self, orig_size, world: int) -> int:
        n = orig_size[0]
        rows = -(-n // world)
        if tuple(self.shape[1:]) != tuple(orig_size[1:]):
            raise NotImplementedError(f"mxtrain MX all-gather: {self._info.name} must be sharded on dim 0 "
                                      f"(local {list(self.shape)}, full {list(orig_size)})")
        return rows

    def _high_precision_input(self, orig_size, world, param_dtype):
        x = self._data.to(param_dtype)
        rows = self._local_rows(orig_size, world)
        if x.shape[0] != rows:  # uneven sharding: FSDP wants every rank's input padded to the same size
            padded = x.new_zeros((rows, *x.shape[1:]))
            padded[: x.shape[0]].copy_(x)
            x = padded
        return (x.contiguous(),), {"kind": "hp", "what": "high_precision", "shape": tuple(orig_size),
                                   "dtype": param_dtype, "world": world}

    def _mx_input(self, uses, orig_size, world, param_dtype):
        n = orig_size[0]
        rows = self._local_rows(orig_size, world)
        check_shard_shape(self._info.name, tuple(orig_size), world, [spec.block_size for spec, a in uses if a == 0])
        by_spec: dict = {}
        for spec, axis in uses:
            by_spec.setdefault(spec, []).append(axis)
        buf = None
        if len(by_spec) == 1 and self._data.is_cuda:
            # the CUDA cast writes the planes straight into the send buffer, rounding fp32 master weights to
            # bf16 params inside the kernel: the same bytes as the general path below, two passes fewer
            ((spec, axes),) = by_spec.items()
            fast = cast_planes_into(self._data, parse_format(spec.fmt), spec.block_size, tuple(axes),
                                    spec.scale_mode, spec.rounding, param_dtype)
            if fast is not None:
                buf, mx = fast
                casts = [(spec, mx)]
        if buf is None:
            x = self._data.to(param_dtype)
            casts = [(spec, quantize(x, spec.fmt, block_size=spec.block_size, axis=tuple(axes),
                                     scale_mode=spec.scale_mode, rounding=spec.rounding))
                     for spec, axes in by_spec.items()]
            pieces = [t.reshape(-1) for _, mx in casts for p in mx.planes for t in (p.data, p.scale)]
            buf = torch.cat(pieces) if len(pieces) > 1 else pieces[0].contiguous()
        planes = [{"spec": spec, "axis": p.axis, "packed": p.packed, "data_shape": tuple(p.data.shape),
                   "scale_shape": tuple(p.scale.shape), "fmt": mx.fmt, "block_size": mx.block_size,
                   "scale_mode": mx.scale_mode, "rounding": mx.rounding, "whole_axis": mx.whole_axis}
                  for spec, mx in casts for p in mx.planes]
        axes = {p["axis"] for p in planes}
        what = "both" if len(axes) > 1 else ("rowwise" if 1 in axes else "columnwise")
        assert rows * world == n
        return (buf,), {"kind": "mx", "what": what, "planes": planes, "shape": tuple(orig_size),
                        "dtype": param_dtype, "world": world}

    # ---- FP8 recipes (Float8CurrentScaling, DelayedScaling, Float8BlockScaling)

    def _fp8_uses(self, recipe, roles, phase, group, module):
        """The ``(Float8RoleSpec, axis)`` uses this gather serves from FP8 codes, or None (high precision).

        One rowwise cast serves both planes: the dgrad plane is the transpose of the gathered codes
        (with the transposed block scales), exactly what casting the full weight gives."""
        stateless = getattr(recipe, "make_state", None) is None
        if stateless:  # the answer depends on the (frozen) recipe and the roles only: the last one kept
            last = getattr(self, "_mx_fp8_uses", None)
            if last is not None and last[0] is recipe and last[1] == roles:
                return last[2]
        TrainingState = _fsdp_training_state_enum()
        if not stateless:  # DelayedScaling: the module's scales
            if getattr(type(module), "gather_quantizers", None) is None:  # a module that keeps no recipe state
                return None
            keep = not getattr(group, "reshard_after_backward", True)
            if keep and (phase == TrainingState.PRE_BACKWARD or not group._reshard_after_forward):
                # the gathered weight would also serve the next forward, which updates the scales first
                return None
            if phase == TrainingState.FORWARD or (phase == TrainingState.PRE_BACKWARD
                                                  and self._info.activation_checkpointing):
                # the module's forward (or its recompute) updates its scales before it casts; update them
                # now so the codes carry the scale it will use (its own update then finds nothing new)
                recipe = module.gather_quantizers(recipe, self._info.gemm)  # .role(name) as a recipe's
            elif phase == TrainingState.PRE_BACKWARD:
                recipe = module.gather_quantizers(recipe, self._info.gemm, update=False)
            else:
                recipe = None
            if recipe is None:
                return None
        uses = [(recipe.role(role), axis) for role, axis in roles]
        spec = uses[0][0]
        if (any(s is not spec and s != spec for s, _ in uses[1:])  # (hashing a spec costs more than comparing)
                or not isinstance(spec, Float8RoleSpec) or spec.fmt is None
                or spec.block not in (None, (BLOCK_LEN, BLOCK_LEN))):
            uses = None
        if stateless:
            self._mx_fp8_uses = (recipe, list(roles), uses)
        return uses

    def _local_amax(self, block, orig_size, rank: int, world: int, out: torch.Tensor | None):
        """This shard's part of the weight's amax, not yet rounded to the param dtype (NaN kept).

        Per-tensor: the shard's ``(min, max)`` (zeros when it is empty). 128 x 128 blocks: the block amaxes of
        this rank's rows written into ``out``, the full weight's ``[ceil(N/128), ceil(K/128)]`` grid (zeros
        elsewhere, for an all-reduce MAX); returns None."""
        x = self._data
        if block is None:
            return torch.aminmax(x) if x.numel() else (x.new_zeros(()), x.new_zeros(()))
        n = orig_size[0]
        r0 = rank * (-(-n // world))
        if x.shape[0]:
            top, k = r0 % BLOCK_LEN, x.shape[1]  # the shard starts inside a block: align it (pad rows are zeros)
            bottom, right = -(top + x.shape[0]) % BLOCK_LEN, -k % BLOCK_LEN
            if top or bottom or right:
                x = torch.nn.functional.pad(x, (0, right, top, bottom))
            part = x.reshape(x.shape[0] // BLOCK_LEN, BLOCK_LEN, -1, BLOCK_LEN).abs().amax(dim=(1, 3))
            out[r0 // BLOCK_LEN:r0 // BLOCK_LEN + part.shape[0]] = part
        return None

    def _fp8_scales(self, spec, fsdp_param, group, pg, param_dtype):
        """``(amax, scale, scale_inv)`` of the full weight (per tensor, or per 128 x 128 block), the same on
        every rank: one all-reduce, and one pass of the scale math, for every weight of the FSDP group.

        The first weight of a group to be gathered does it for all of them and keeps the results on the
        group; later gathers of the group (its other weights in the same all-gather, and the backward
        all-gather after a reshard) take theirs without an amax pass or all-reduce while no member's data
        has changed since (see ``_fp8_cached``). scale and scale_inv are None where the cast does not need
        them: delayed scaling (the module's scale) and per-tensor casts on the Triton backend (the kernel
        makes them from the amax). The amax is of the weight in ``param_dtype``: rounding is monotonic and
        symmetric, so it is the rounded amax of the master weight."""
        key = _amax_key(spec, param_dtype)
        hit = _fp8_cached(group, key, fsdp_param)
        if hit is not None:
            return hit
        # per-tensor scales: the amaxes of every FP8-gathered weight of every FSDP group on this process group,
        # in one all-reduce (the first gather of a step; the others find theirs): one collective a step,
        # not one per layer (torchao's precompute_float8_dynamic_scale_for_fsdp, without the call). 128 x 128
        # blocks: this group's (their amax grids are larger)
        groups = [group] if spec.block is not None else _peer_groups(group, pg)
        per_group = [[fp for fp in g.fsdp_params if isinstance(fp._sharded_local_tensor, MXAllGatherWeight)]
                     for g in groups]
        if not any(fp is fsdp_param for fp in per_group[0]):
            per_group[0].append(fsdp_param)
        members = [fp for ms in per_group for fp in ms]
        rank, world = pg.rank(), pg.size()
        weights = [self if fp is fsdp_param else fp._sharded_local_tensor for fp in members]
        sizes = [tuple(fp._orig_size) for fp in members]
        datas = [w._data for w in weights]
        # per-tensor current scaling of non-empty 2-D shards: every member's amax, then its codes, in one launch
        # each on CUDA (mxtrain.kernels.shard_cast; the gathers then send the codes made here)
        batched = spec.block is None and spec.scaling != "delayed" and _batchable(datas, param_dtype, self.device)
        flat = _batched_call(shard_amaxes, datas) if batched else None
        batched = flat is not None  # (None: the batch failed; the per-weight path, the same values)
        if batched:
            shapes = None
        elif spec.block is None:
            shapes = None
            lo, hi = zip(*(w._local_amax(None, size, rank, world, None) for w, size in zip(weights, sizes)))
            # max(|min|, |max|) of each weight: its max |x| (+0 for zeros), NaN kept
            flat = torch.stack(lo + hi).abs().view(2, -1).amax(0).float()
        else:
            shapes = [(-(-n // BLOCK_LEN), -(-k // BLOCK_LEN)) for n, k in sizes]
            flat = torch.zeros(sum(math.prod(s) for s in shapes), dtype=torch.float32, device=self.device)
            off = 0
            for w, size, shape in zip(weights, sizes, shapes):
                w._local_amax(spec.block, size, rank, world, flat[off:off + math.prod(shape)].view(shape))
                off += math.prod(shape)
        inf = float("inf")
        flat = torch.nan_to_num(flat, nan=inf, posinf=inf)  # a NaN makes the amax +Inf
        if param_dtype != torch.float32:
            flat = flat.to(param_dtype).float()
        all_reduce_amax(flat, pg)
        _STATS.amax_reductions += 1
        _STATS.amax_bytes += flat.numel() * flat.element_size()
        scale = scale_inv = None
        if batched or spec.block is not None or (spec.scaling != "delayed"
                                                 and _triton_float8_casts(self.device, param_dtype) is None):
            scale = compute_scale(flat, FP8_MAX[spec.fmt], power_of_2=spec.power_of_2_scales,
                                  epsilon=spec.amax_epsilon)
            scale_inv = torch.reciprocal(scale)
        codes = _batched_call(shard_codes, datas, scale, param_dtype, spec.fmt) if batched else None
        if shapes is None:  # one 0-d view per weight
            if scale_inv is not None:  # each on a 16-byte boundary: cuBLASLt reads a GEMM's scale there only
                spaced = scale_inv.new_zeros((scale_inv.numel(), 4))
                spaced[:, 0] = scale_inv
                scale_inv = spaced[:, 0]
            parts = [((None,) * len(members)) if t is None else t.unbind() for t in (flat, scale, scale_inv)]
        else:
            numels = [math.prod(shape) for shape in shapes]
            parts = [((None,) * len(members)) if t is None else
                     [p.view(shape) for p, shape in zip(t.split(numels), shapes)] for t in (flat, scale, scale_inv)]
        # what the reuse check compares: each member's sharded tensor, its data and that data's version
        seen = tuple((fp, w, w._data, w._data._version) for fp, w in zip(members, weights))
        results = tuple(zip(*parts))
        start = 0
        for g, ms in zip(groups, per_group):
            g._mxtrain_fp8_amax = (key, seen[start:start + len(ms)], results[start:start + len(ms)])
            # each member's codes until its gather takes them (stale ones, of a weight written since, are not)
            g._mxtrain_fp8_codes = (None if codes is None else
                                    {fp: (c, d, d._version) for fp, c, d in zip(ms, codes[start:], datas[start:])})
            start += len(ms)
        return results[[fp is fsdp_param for fp in members].index(True)]

    def _delayed_scale(self, spec, fmt, amax, device) -> torch.Tensor:
        """The DelayedScaling scale of this gather's cast: the state's, or the last gather's while neither the
        state's scales (no eager update since) nor the weight changed. A backward gather then casts the codes
        its forward gather cast, as one process's forward keeps its weight cast for backward. (Asked anew, a
        state's answer can change in between without an update: a compiled forward's update marks every
        slot seasoned while it is traced, so a fresh slot's amax-derived first scale became the initial
        scale of 1 in backward, and the compiled first step's gradients differed from eager's.)"""
        key = (spec.state, spec.slot, spec.state.eager_updates, self._data._version)
        last = self._info.delayed_cast
        if last is not None and last[:4] == key:  # the state by identity (it defines no __eq__)
            return last[4]
        scale = spec.state.scale_for(spec.slot, fmt, device, amax=amax)
        self._info.delayed_cast = (*key, scale)
        return scale

    def _fp8_input(self, uses, fsdp_param, group, orig_size, world, param_dtype, sent=None, keep=False,
                   fresh=False):
        """This rank's rows as FP8 codes (uint8, padded to FSDP's shard rows); the scale(s) in the metadata.

        Every rank derives the same scales from the all-reduced amax (current, block) or from the
        module's state (delayed), so only the codes travel: 1 byte per element. ``sent``: the forward
        gather's codes, sent again when they were cast at the very scales this gather casts at (the
        same result objects of the amax all-reduce or of the delayed state) from the unchanged weight."""
        spec = uses[0][0]
        n, k = orig_size
        rows = self._local_rows(orig_size, world)
        pg = fsdp_param.mesh_info.shard_process_group
        scales = self._fp8_scales(spec, fsdp_param, group, pg, param_dtype)
        amax, scale, scale_inv = scales
        fmt = spec.fmt
        if spec.block is None and spec.scaling == "delayed":
            scale = self._delayed_scale(spec, fmt, amax, self.device)
        key = ("fp8", fmt, spec.block, spec.scaling, spec.power_of_2_scales, spec.amax_epsilon, param_dtype, world,
               tuple(orig_size))
        refs = (scales, scale)
        current = spec.block is None and spec.scaling != "delayed"  # (per-tensor current scaling: batched casts)
        made = _take_codes(group, fsdp_param, self._data) if current else None
        resend = sent is not None and sent.holds(self._data, key, refs)
        if made is None and fresh and not resend and current and _batched_casts(self.device):
            _rebatch_codes(group, pg, spec, param_dtype, self.device)
            made = _take_codes(group, fsdp_param, self._data)
        if resend:
            buf, scale_inv, amax = sent.codes, sent.scale_inv, sent.amax
            _STATS.resent += 1
        else:
            if made is not None:  # the step's batched cast made them (_fp8_scales)
                buf = made.view(torch.uint8)
                if buf.shape[0] != rows:  # uneven sharding: FSDP wants every rank's input padded to the same rows
                    buf = torch.cat([buf, buf.new_zeros((rows - buf.shape[0], k))])
                _STATS.batched += 1
            else:
                buf, scale_inv, amax = self._fp8_codes(spec, pg, orig_size, rows, param_dtype, amax, scale,
                                                       scale_inv)
            if keep:
                self._mx_sent = _SentShard(self._data, key, refs, buf, scale_inv, amax)
        axes = {axis for _, axis in uses}
        what = "both" if len(axes) > 1 else ("rowwise" if 1 in axes else "columnwise")
        # host-side only (no device sync per step): FSDP2 gathers eagerly, and the update before this cast took
        # every amax recorded so far, so the forward's own update (compiled or not) finds nothing new and leaves
        # the scales as cast here; only a later eager update with new amaxes makes these codes stale (not seen:
        # a compiled forward of a module called twice per gather, whose second update finds the first's amaxes)
        updates = spec.state.eager_updates if spec.scaling == "delayed" else None
        return (buf,), {
            "kind": "fp8", "what": what, "shape": tuple(orig_size), "dtype": param_dtype, "world": world,
            "fmt": fmt, "block": spec.block, "scale_inv": scale_inv, "amax": amax,
            "specs": {axis: spec for spec, axis in uses}, "updates": updates}

    def _fp8_codes(self, spec, pg, orig_size, rows, param_dtype, amax, scale, scale_inv):
        """``(codes as uint8 [rows, K], scale_inv, amax)`` of this rank's shard cast at the given scale(s)."""
        n, k = orig_size
        x = self._data.to(param_dtype).contiguous()
        fmt = spec.fmt
        kernels = _triton_float8_casts(x.device, x.dtype) if x.numel() else None
        if spec.block is None:
            if kernels is not None:  # one kernel: the codes and scale_inv (from the given scale, or the amax)
                q, _ = kernels[0](x, fmt, scale=scale, amax=None if scale is not None else amax,
                                  power_of_2_scales=spec.power_of_2_scales, amax_epsilon=spec.amax_epsilon)
                codes, scale_inv = q.planes[0].data, q.scale_inv
            else:
                if scale is None:  # an empty shard on the Triton backend
                    scale = compute_scale(amax, FP8_MAX[fmt], power_of_2=spec.power_of_2_scales,
                                          epsilon=spec.amax_epsilon)
                codes = cast_to_fp8(x, scale, fmt)
                if scale_inv is None:
                    scale_inv = torch.reciprocal(scale)
        else:
            amax = None
            r0, length = pg.rank() * rows, x.shape[0]
            if length == 0:
                codes = torch.empty((0, k), dtype=FP8_DTYPES[fmt], device=x.device)
            elif kernels is not None and r0 % BLOCK_LEN == 0 and (length % BLOCK_LEN == 0 or r0 + length == n):
                # whole blocks: their scales from this shard are the full weight's (the fast cast)
                codes = kernels[1](x, fmt, spec.block, rowwise=True, power_of_2_scales=spec.power_of_2_scales,
                                   amax_epsilon=spec.amax_epsilon)[0].planes[0].data
            else:  # the global block scales of this shard's rows, element by element
                top = r0 % BLOCK_LEN
                s = scale[r0 // BLOCK_LEN:(r0 + length - 1) // BLOCK_LEN + 1]
                s = s.repeat_interleave(BLOCK_LEN, dim=0)[top:top + length].repeat_interleave(BLOCK_LEN, dim=1)
                codes = cast_to_fp8(x, s[:, :k], fmt)
        buf = codes.view(torch.uint8)
        if buf.shape[0] != rows:  # uneven sharding: FSDP wants every rank's input padded to the same rows
            buf = torch.cat([buf, buf.new_zeros((rows - buf.shape[0], k))])
        return buf, scale_inv, amax

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (buf,) = all_gather_outputs
        if out is None:
            state = _GatheredState(name=self._info.name, inner=[buf.new_empty(0, dtype=torch.uint8)],
                                   activation_checkpointing=self._info.activation_checkpointing,
                                   owner=weakref.ref(self))
            result = MXGatheredWeight(metadata["shape"], param_dtype, buf.device, state)
            state.anchor = _GatheredAnchor.make(state, metadata["shape"], param_dtype, buf.device)
        else:
            if not isinstance(out, MXGatheredWeight):
                raise RuntimeError(f"mxtrain MX all-gather: expected out to be an MXGatheredWeight, got {type(out)}")
            state = out._state
            if metadata["kind"] == "fp8" and state.transposed is not metadata:
                _batch_transposes(self, buf, metadata, state)
        state.fill(buf, metadata)
        if out is None:
            return result, state.inner
        return None


# --------------------------------------------------------------------------- the all-gathered weight

@dataclass
class _PlaneLayout:
    """Where a traced MX weight's two planes lie in its gathered buffer (``_GatheredState.inner[0]``)."""

    places: dict  # axis -> (the plane's description, its offset in the buffer, its spec object)
    bytes: int  # the buffer's size
    key: tuple  # what made it (_mx_layout_key): a forward gather sends one plane into it only under the same key


@dataclass
class _GatheredState:
    """What the last all-gather brought: full MX planes (in ``inner[0]``) or the high-precision weight.

    ``inner`` is the list FSDP2 keeps as the unsharded parameter's inner tensors:
    FSDP frees their storage when it reshards and reallocates it before the next
    all-gather. When the planes need a different size, its one element is replaced.
    """

    name: str
    inner: list
    hp: torch.Tensor | None = None
    planes: dict = field(default_factory=dict)  # axis -> (role spec, MXTensor / Float8Tensor holding that one plane)
    delayed_updates: int | None = None  # DelayedScaling: the state's update count the FP8 codes were cast at
    activation_checkpointing: bool = False
    owner: Any = None  # weakref to the sharded MXAllGatherWeight (its FSDPParam holds the unsharded parameter)
    kept: bool = False  # the planes serve backward too (not gathered again, or refilled in place before it)
    anchor: Any = None  # the _GatheredAnchor traced modules take in place of the weight (made with the state)
    # axes (1 rowwise, 0 columnwise) whose planes are laid out but not written by the last gather: a traced
    # module's (FP8: the dgrad plane of a forward gather; MX: the plane the pass does not read). The gather
    # before the pass that reads one writes it there. An eager use of one before then: FP8 transposes the
    # gathered codes; MX has no such plane
    pending: frozenset = frozenset()
    layout: Any = None  # MX, traced: where both planes lie in inner[0] (_PlaneLayout), once a gather laid them out
    transposed: Any = None  # the gather metadata whose dgrad plane the group's batched transposes wrote already

    def fill(self, buf: torch.Tensor, meta: dict) -> None:
        world, shape = meta["world"], meta["shape"]
        self.kept = meta.get("kept", False)
        if meta["kind"] == "fp8":
            self._fill_fp8(buf, meta)
            return
        if meta["kind"] == "hp":
            self.planes, self.pending, self.layout = {}, frozenset(), None
            self._mark_layout()
            self.hp = buf.view(-1, *shape[1:])[: shape[0]]
            _free(self.inner[0])
            return
        self.hp = None
        per_rank = buf.view(world, -1)
        if _gather_values(buf.device, meta["dtype"]):
            self._fill_values(per_rank, meta)
            _free(buf)
            return
        sizes = [(math.prod(p["data_shape"]) + math.prod(p["scale_shape"])) * world for p in meta["planes"]]
        arena, offsets = self._place(meta, sizes, False, buf.device)
        planes, src_off = {}, 0
        for p, dst_off in zip(meta["planes"], offsets):
            full = []
            for shard_shape in (p["data_shape"], p["scale_shape"]):
                numel = math.prod(shard_shape)
                src = per_rank[:, src_off:src_off + numel].view(world, *shard_shape)
                dst = arena[dst_off:dst_off + numel * world]
                # a refill (the same bytes, as FSDP2's own copy-out) must not fail the version check of the
                # planes a traced forward saved for its backward
                with torch.autograd._unsafe_preserve_version_counter(arena):
                    if p["axis"] == 1:  # rowwise [rows, ...]: ranks stack along dim 0
                        full.append(dst.view(world, *shard_shape).copy_(src).view(world * shard_shape[0], -1))
                    else:  # columnwise [K, rows...]: the sharded dim is the stored last dim
                        dst2 = dst.view(shard_shape[0], world, shard_shape[1])
                        dst2.copy_(src.permute(1, 0, 2))
                        full.append(dst2.view(shard_shape[0], world * shard_shape[1]))
                src_off += numel
                dst_off += numel * world
            mxt = MXTensor(planes=(MXPlane(data=full[0], scale=full[1], axis=p["axis"], packed=p["packed"]),),
                           fmt=p["fmt"], block_size=p["block_size"], shape=tuple(shape), dtype=meta["dtype"],
                           scale_mode=p["scale_mode"], rounding=p["rounding"], whole_axis=p["whole_axis"])
            planes[p["axis"]] = (p["spec"], mxt)
        self._set_planes(planes)
        # The planes are copied out: give the all-gather output's memory back now rather than
        # at reshard (FSDP reallocates it before the next all-gather).
        _free(buf)

    def _place(self, meta: dict, sizes: list, values: bool, device) -> tuple:
        """``(inner[0], offset of each of meta's planes in it)``. A traced MX weight (``meta["in_place"]``) keeps its
        planes in fixed places once a gather of both laid them out: a later gather that sends some of them writes
        each into its place (the arena, and the planes of the others, as they are), so the buffers a traced
        forward saved are the ones the backward's gather writes. Otherwise the planes are laid out in order."""
        keys = [(p["axis"], p["data_shape"], p["scale_shape"], p["fmt"], p["block_size"], p["packed"],
                 p["scale_mode"], p["rounding"], p["whole_axis"], values, meta["dtype"], meta["world"], p["spec"])
                for p in meta["planes"]]
        arena = self.inner[0]
        lay = self.layout
        if (meta.get("in_place") and lay is not None and arena.numel() == lay.bytes
                and all(lay.places.get(k[0], (None,))[0] == k for k in keys)):
            self.pending = frozenset(lay.places) - {k[0] for k in keys}
            for p in meta["planes"]:  # the spec objects of the laid-out planes (equal ones: a traced graph's guards
                p["spec"] = lay.places[p["axis"]][2]  # compare them by identity)
            return arena, [lay.places[k[0]][1] for k in keys]
        total = sum(sizes)
        if arena.numel() != total:
            _free(arena)
            arena = self.inner[0] = torch.empty(total, dtype=torch.uint8, device=device)
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        both = {k[0] for k in keys} == {0, 1}
        self.layout = None
        if meta.get("in_place") and both:
            specs = {p["axis"]: p["spec"] for p in meta["planes"]}
            self.layout = _PlaneLayout(
                places={k[0]: (k, off, p["spec"]) for k, off, p in zip(keys, offsets, meta["planes"])}, bytes=total,
                key=_layout_key(specs[1], specs[0], meta["dtype"], meta["world"], values))
        self.pending = frozenset()
        return arena, offsets

    def _set_planes(self, planes: dict) -> None:
        """The planes this gather wrote, beside those laid out before and not written now (``pending``)."""
        merged = {**{a: e for a, e in self.planes.items() if a in self.pending}, **planes}
        self.planes = {a: merged[a] for a in sorted(merged, reverse=True)}  # rowwise first, as a traced graph saw
        self._mark_layout()

    def _mark_layout(self) -> None:
        # what the sharded weight's next gather reads: whether it may send one plane (see fsdp_pre_all_gather)
        owner = self.owner() if self.owner is not None else None
        if owner is not None:
            owner._info.mx_layout = None if self.layout is None else self.layout.key

    def _fill_fp8(self, buf: torch.Tensor, meta: dict) -> None:
        """FP8 planes of the full weight: the gathered rows are its rowwise codes as they are (rank r's
        are rows r*rows..), the dgrad plane their transpose; the scale (or the 128 x 128 block scales,
        transposed for the dgrad plane) is the one every rank cast with."""
        self.hp = None
        n, k = meta["shape"]
        fp8 = FP8_DTYPES[meta["fmt"]]
        row = buf.view(fp8).view(-1, k)[:n]
        block, scale_inv = meta["block"], meta["scale_inv"]
        planes = {}
        self.pending, self.layout = frozenset(), None
        self._mark_layout()
        for axis, spec in meta["specs"].items():
            if axis == 1:
                plane = Float8Plane(row, scale_inv, 1, block)
            else:
                arena = self.inner[0]
                if arena.numel() != n * k:
                    _free(arena)
                    arena = self.inner[0] = torch.empty(n * k, dtype=torch.uint8, device=buf.device)
                col = arena.view(fp8).view(k, n)
                if meta.get("dgrad_later"):
                    self.pending = frozenset((0,))
                elif self.transposed is meta:  # written by the group's batched transposes (_batch_transposes)
                    self.transposed = None
                else:
                    with torch.autograd._unsafe_preserve_version_counter(arena):  # as in fill
                        transpose_bytes(row, col)  # (torch's strided copy of bytes: a tenth of the bandwidth)
                    _STATS.transposes += 1
                plane = Float8Plane(col, scale_inv if block is None else scale_inv.t().contiguous(), 0, block)
            planes[axis] = (spec, Float8Tensor((plane,), meta["fmt"], (n, k), meta["dtype"], meta["amax"]))
        self.planes, self.delayed_updates = planes, meta["updates"]
        if 0 not in planes:
            _free(self.inner[0])
        if 1 not in planes:  # backward needs the transpose only: give the gathered codes back now
            _free(buf)

    def _fill_values(self, per_rank: torch.Tensor, meta: dict) -> None:
        """Each gathered plane as the full weight's dequantized values (bf16 for bf16 params), written
        straight from the gather buffer, every rank's rows in one launch: rank r's codes are rows
        r*n/world.. of the full weight in either orientation (the columnwise plane's blocks never cross
        a shard: checked before the gather), so the result is the dequantized plane of the full
        weight, bit for bit."""
        from mxtrain.kernels.dequantize import triton_dequantize_shards

        world, shape, dtype = meta["world"], tuple(meta["shape"]), meta["dtype"]
        rows = shape[0] // world
        numel = math.prod(shape)
        itemsize = dtype.itemsize
        arena, offsets = self._place(meta, [numel * itemsize] * len(meta["planes"]), True, per_rank.device)
        planes, src_off = {}, 0
        step = per_rank.stride(0)
        for p, off in zip(meta["planes"], offsets):
            full = arena[off:off + numel * itemsize].view(dtype).view(shape)
            nd, ns = math.prod(p["data_shape"]), math.prod(p["scale_shape"])
            # rank 0's plane; rank r's lies one row of the gather buffer further: one launch writes them all
            # (the CUDA dequantize where it applies, else Triton's)
            plane = MXPlane(data=per_rank[0, src_off:src_off + nd].view(p["data_shape"]),
                            scale=per_rank[0, src_off + nd:src_off + nd + ns].view(p["scale_shape"]),
                            axis=p["axis"], packed=p["packed"])
            shard = MXTensor._unchecked((plane,), p["fmt"], p["block_size"], (rows, *shape[1:]), dtype,
                                        p["scale_mode"], p["rounding"], p["whole_axis"])
            with torch.autograd._unsafe_preserve_version_counter(arena):  # as in fill
                triton_dequantize_shards(shard, world, step, step, full, p["axis"])
            src_off += nd + ns
            planes[p["axis"]] = (p["spec"], MXTensor._unchecked((), p["fmt"], p["block_size"], shape, dtype,
                                                                p["scale_mode"], p["rounding"], p["whole_axis"],
                                                                ((p["axis"], full),)))
        self._set_planes(planes)


# "auto": gathered planes become bf16 values where the GEMM would dequantize them anyway (CUDA, bf16
# params, the values policy of mxtrain.modules._common, no block-scaled tensor cores); True / False
# force it (tests run the values path on the CPU). MXTRAIN_GATHER_VALUES=0 / 1 / auto.


def _gather_values(device: torch.device, dtype: torch.dtype) -> bool:
    gather = config.current().gather_values
    if gather != "auto":
        return bool(gather)
    from mxtrain.kernels.gemm import native_mx_gemm

    return (device.type == "cuda" and dtype == torch.bfloat16 and config.current().carry_values
            and not native_mx_gemm(device))


def _free(t: torch.Tensor) -> None:
    storage = t.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


_ALIAS_OPS = {aten.detach.default, aten.alias.default}
_METADATA_OPS = {
    aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
    aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default,
    aten.new_empty_strided.default,
}


class MXGatheredWeight(torch.Tensor):
    """The unsharded weight FSDP2 puts on the module between all-gather and reshard.

    It holds the all-gathered MX planes (what a module's ``Quantizer`` hands to the
    GEMMs) or, after a high-precision gather, the full weight. Any op other than
    the module's GEMM path runs on the high-precision weight, and fails with an
    explanation when only MX planes were gathered.
    """

    _state: _GatheredState

    @staticmethod
    def __new__(cls, shape, dtype, device, state, requires_grad: bool = False):
        return torch.Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=dtype, device=device,
                                                   requires_grad=requires_grad)

    def __init__(self, shape, dtype, device, state, requires_grad: bool = False):
        self._state = state

    def __repr__(self) -> str:
        s = self._state
        what = "high precision" if s.hp is not None else (
            "MX " + ", ".join("rowwise" if a == 1 else "columnwise" for a in sorted(s.planes)) or "nothing")
        return f"MXGatheredWeight(name={s.name!r}, shape={list(self.shape)}, dtype={self.dtype}, holds={what})"

    def mx_gathered_plane(self, spec, axis: int) -> MXTensor | Float8Tensor | None:
        """The all-gathered MX or FP8 plane for ``(spec, axis)``, or None when it was not gathered for that spec.

        For DelayedScaling it records the weight's amax in the module's state, as the module's cast would."""
        if spec is None or spec.fmt is None:
            return None
        entry = self._state.planes.get(axis % 2)
        row = self._state.planes.get(1)
        if not torch.compiler.is_compiling() and axis % 2 in self._state.pending:
            entry = None  # laid out for a traced pass, not written yet: FP8 transposes the codes (below)
        if entry is None and axis % 2 == 0 and row is not None and isinstance(row[1], Float8Tensor):
            # an FP8 dgrad plane asked for in forward (see mx_keep_dgrad_plane): the transpose of the
            # gathered codes (and block scales) is the full weight's, exactly
            p = row[1].plane(1)
            if torch.compiler.is_compiling():
                data = p.data.t().contiguous()
            else:
                data = transpose_bytes(p.data)
                _STATS.transposes += 1
            col = Float8Plane(data, p.scale_inv if p.block is None else p.scale_inv.t().contiguous(), 0, p.block)
            entry = (row[0], dataclasses.replace(row[1], planes=(col,)))
        if entry is None or (entry[0] != spec and not _first_step_view_of(spec, entry[0])):
            return None
        if isinstance(spec, Float8RoleSpec) and spec.scaling == "delayed":
            if spec.state.eager_updates != self._state.delayed_updates:
                return None  # the module's scales were updated after the cast: these codes are stale
            spec.state.record(spec.slot, entry[1].amax)  # what the module's own cast of the weight records
        return entry[1]

    def mx_keep_dgrad_plane(self, spec) -> bool:
        """Whether a forward that makes the dgrad plane should keep it for backward (``Quantizer.weight_planes``).

        Backward's all-gather brings the dgrad plane, so forward keeps nothing, except for
        DelayedScaling under activation checkpointing: one process's backward then uses the plane
        its first forward made, at the scale before the recomputed forward's update."""
        return (self._state.activation_checkpointing and isinstance(spec, Float8RoleSpec)
                and spec.scaling == "delayed")

    def high_precision(self) -> torch.Tensor:
        """The full high-precision weight; raises when this gather brought MX planes only."""
        if self._state.hp is None:
            have = ", ".join(("rowwise" if a == 1 else "columnwise") + f" {spec}" for a, (spec, _)
                             in sorted(self._state.planes.items())) or "nothing"
            raise RuntimeError(
                f"mxtrain MX all-gather: {self._state.name} was all-gathered by FSDP2 as MX planes only ({have}), "
                "and this use needs another plane or its high-precision values. Run forward under the "
                "mx_autocast recipe the all-gather saw; if the forward is recomputed in backward (activation "
                "checkpointing) call enable_mx_all_gather(model, activation_checkpointing=True); a forward "
                "without mx_autocast must not reuse weights gathered in MX (keep FSDP's reshard after backward on).")
        return self._state.hp

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ALIAS_OPS or (func in (aten.as_strided.default, aten.view.default, aten._unsafe_view.default)
                                  and tuple(args[1]) == tuple(args[0].shape)):
            w = args[0]
            return cls(w.shape, w.dtype, w.device, w._state)

        def unwrap(t):
            if func in _METADATA_OPS and t._state.hp is None:
                return torch.empty(t.shape, dtype=t.dtype, device=t.device)
            return t.high_precision()

        plain_args, plain_kwargs = _map_flat(cls, unwrap, args, kwargs)
        return func(*plain_args, **plain_kwargs)

    def mx_traced_weight(self):
        """What a module traced by ``torch.compile`` hands its autograd function in place of this weight (a
        :class:`_GatheredAnchor`), or a string saying why it cannot be traced.

        Dynamo does not take this subclass for a tensor (its ``__torch_dispatch__`` is its own and it has no
        ``__tensor_flatten__``): it traces ``mx_gathered_plane`` as Python, lifts the plane tensors as graph
        inputs, and the weight itself never enters the graph, so its gradient would be dropped. The anchor
        is the weight's graph input: its gradient goes to FSDP's unsharded parameter. The backward graph
        reads the planes the forward saw, so it traces where those serve backward: no reshard after forward,
        or a weight whose gathers all lay out both planes in one place (``_WeightInfo.traced``: FSDP2's
        backward gather then refills the same buffers before backward). A weight traced for the first time by a
        module that is not itself the ``torch.compile`` wrapper FSDP2 manages runs its first step eagerly (see
        :meth:`mx_trace_next_gathers`).
        DelayedScaling (amax records, stale-code check) runs eagerly."""
        s = self._state
        # the anchor is made with the state, by FSDP2's post-all-gather, which also sets the owner; the owner (the
        # sharded weight, a traceable subclass) is not read here: dynamo would guard on its per-weight metadata, and
        # every compiled block of a model would then recompile (past dynamo's limit: the rest ran eagerly)
        if s.anchor is None:
            return f"{s.name} was not all-gathered by FSDP2"
        if not s.kept:
            return (f"{s.name} was gathered for forward only (its backward plane comes in a later gather, which a "
                    "traced backward cannot see); its gathers lay out both planes from now on, and it traces from the "
                    "next step")
        if any(isinstance(spec, Float8RoleSpec) and spec.scaling == "delayed" for spec, _ in s.planes.values()):
            return f"{s.name} carries DelayedScaling codes (their amax records and staleness check run eagerly)"
        return s.anchor

    def mx_trace_next_gathers(self) -> None:
        """From the next all-gather on, lay out both planes of this weight in one place at every gather, so that
        a traced module can save the forward's planes for its backward (the backward gather refills them)."""
        owner = self._state.owner() if self._state.owner is not None else None
        if owner is not None:
            owner._info.traced = True


def _first_step_view_of(spec, gathered) -> bool:
    """Whether ``spec`` is ``gathered`` seen through a compiled first step's view of its DelayedScaling state
    (``FirstStepState``: fresh slots scaled from their own amax, as an eager first step scales them, and amaxes
    recorded into the state). FSDP2's pre-gather cast the codes with the state itself, at the scale an eager
    module takes: the same cast (a compiled block's module asked for the high-precision weight instead, which
    was not gathered, and failed its first forward). The view says which state it views (``first_step_of``)."""
    viewed = getattr(getattr(spec, "state", None), "first_step_of", None)
    return (viewed is not None and isinstance(gathered, Float8RoleSpec) and viewed is gathered.state
            and dataclasses.replace(spec, state=viewed) == gathered)


@functools.cache
def _optimized_module_type():
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # a torch without dynamo
        return None
    return OptimizedModule


def _compiled_group(group) -> bool:
    """Whether an FSDP2 group was made by ``fully_shard`` of a ``torch.compile`` wrapper (a block compiled before
    ``fully_shard``, as torchtitan compiles each transformer block): its weights will be traced."""
    cls = _optimized_module_type()
    return cls is not None and any(isinstance(m, cls) for m in getattr(group, "modules", ()))


class _GatheredAnchor(torch.Tensor):
    """A traced module's stand-in for an :class:`MXGatheredWeight`: a plain tensor to dynamo (one stored
    element, expanded to the weight's shape; no op reads it) that answers the Quantizer as the gathered
    weight does, and whose gradient, once accumulated, moves to FSDP's unsharded parameter (which FSDP2's
    post-backward reduce-scatters), as eager autograd puts it there."""

    mx_gathered_plane = MXGatheredWeight.mx_gathered_plane
    mx_keep_dgrad_plane = MXGatheredWeight.mx_keep_dgrad_plane
    high_precision = MXGatheredWeight.high_precision

    @staticmethod
    def make(state, shape, dtype, device) -> "_GatheredAnchor":
        data = torch.zeros((), dtype=dtype, device=device).expand(tuple(shape))
        anchor = torch.Tensor._make_subclass(_GatheredAnchor, data, True)
        anchor._state = state
        anchor.register_post_accumulate_grad_hook(_anchor_grad_to_param)
        return anchor


def _anchor_grad_to_param(anchor: torch.Tensor) -> None:
    grad, anchor.grad = anchor.grad, None
    owner = anchor._state.owner()
    if owner is None or grad is None:
        return
    param = _find_fsdp_param(owner)[0].unsharded_param
    if not param.requires_grad:
        return
    with torch.no_grad():  # what AccumulateGrad does to the parameter in eager
        if param.grad is None:
            param.grad = grad
        else:
            param.grad += grad


# --------------------------------------------------------------------------- CUDA-graphed steps

def _live_param_groups() -> list:
    """Every FSDP2 parameter group of a live FSDP state in this process (any model)."""
    from torch.distributed._composable_state import _module_state_mapping
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    groups = []
    for ref in list(_module_state_mapping.values()):
        state = ref()
        if isinstance(state, FSDPState):
            groups.extend(_param_groups(state))
    return groups


def _leaves(t: torch.Tensor) -> list:
    """``t`` and, through ``__tensor_flatten__``, every tensor a wrapper subclass holds (a DTensor's local
    tensor, an ``MXAllGatherWeight``'s data): each has a version counter of its own."""
    out = [t]
    if type(t) is not torch.Tensor and type(t) is not nn.Parameter and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        for name in names:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):  # (a name may hold other objects: a DTensor's mesh, on some torch)
                out.extend(_leaves(inner))
    return out


class ReplayBookkeeping:
    """What a CUDA graph of an FSDP2 step owes FSDP2's and mxtrain's host state on each replay
    (``mxtrain.make_graphed_step`` makes one around its capture when FSDP2 states exist).

    A replay runs the step's gathers, GEMMs and optimizer without any Python, and two kinds of host state
    must still tell the truth afterwards:

    * which parameter groups are unsharded. An eager forward between replays (an evaluation) leaves the groups
      that keep their weights after forward (``reshard_after_forward=False``, and FSDP2's root) unsharded; the
      next eager forward would use those gathered weights, made before the replays updated the shards. Before a
      replay, every unsharded group is resharded (the captured step began with every group sharded).
    * the version counters of the sharded parameters. mxtrain's quantized gathers reuse a weight's amax, codes
      and scales while its version is unchanged (``_fp8_cached``, ``_take_codes``, ``_SentShard``); an optimizer
      step inside the graph changes the weight without counting. After a replay, the version of every tensor of
      each parameter the captured step wrote is bumped (those whose version moved during the capture).
    """

    def __init__(self):
        self._before = [(g, [(leaf, leaf._version) for fp in g.fsdp_params for leaf in _leaves(fp.sharded_param)])
                        for g in _live_param_groups()]
        self.written: list = []  # the leaves of the parameters the captured step wrote

    def captured(self) -> None:
        """Call after the capture: keep the parameters whose version moved in it."""
        self.written = [leaf for _, leaves in self._before for leaf, version in leaves if leaf._version != version]
        self._before = None

    @staticmethod
    def before_replay() -> None:
        for group in _live_param_groups():
            if group.is_unsharded:
                group.reshard()

    def after_replay(self) -> None:
        if self.written:
            torch.autograd.graph.increment_version(self.written)


# --------------------------------------------------------------------------- setup

def check_shard_shape(name: str, shape: tuple, world: int, column_block_sizes=(32,)) -> None:
    """Raise ValueError when FSDP2's dim-0 shards of ``shape`` cannot carry exact MX planes.

    Every rank must hold the same number of rows (FSDP2 requires all-gather inputs of the
    padded shard size, which a packed MX buffer cannot have), and for the columnwise plane
    (blocks along dim 0) each rank's rows must be whole blocks, or a block would straddle
    two ranks and quantize differently from the full weight.
    """
    n = shape[0]
    if n % world:
        raise ValueError(
            f"mxtrain MX all-gather: {name} {list(shape)} has {n} rows, which {world} ranks cannot share "
            f"evenly; make dim 0 a multiple of {world} or leave this weight out "
            "(enable_mx_all_gather(..., strict=False) gathers it in high precision)")
    rows = n // world
    for bs in column_block_sizes:
        if bs == 0 or rows % bs:
            need = world * bs if bs else None
            hint = (f"make dim 0 a multiple of {need} (e.g. {-(-n // need) * need})" if need else
                    "whole-axis blocks (block_size=0) along dim 0 cannot be split by rank")
            raise ValueError(
                f"mxtrain MX all-gather: {name} {list(shape)} is sharded into {rows} rows per rank over {world} "
                f"ranks, but its columnwise MX blocks of {bs or 'the whole axis'} run along dim 0, so a block would "
                f"span two ranks; {hint}, or leave this weight out "
                "(enable_mx_all_gather(..., strict=False) gathers it in high precision)")


def check_mx_all_gather_shapes(model: nn.Module, world_size: int, block_size: int = 32) -> list[str]:
    """Messages for every mxtrain weight of ``model`` that cannot all-gather in MX over ``world_size`` ranks."""
    problems = []
    for mod_name, m in model.named_modules():
        for pname in mx_weight_names(m):
            p = getattr(m, pname, None)
            if p is None:
                continue
            try:
                check_shard_shape(f"{mod_name}.{pname}".lstrip("."), tuple(p.shape), world_size, (block_size,))
            except ValueError as e:
                problems.append(str(e))
    return problems


def _plain(v):
    from torch.distributed.tensor import DTensor

    if isinstance(v, DTensor) and isinstance(v._local_tensor, MXAllGatherWeight):
        return DTensor.from_local(v._local_tensor._data, v.device_mesh, v.placements, run_check=False,
                                  shape=v.shape, stride=v.stride())
    if isinstance(v, MXAllGatherWeight):
        return v._data
    return v


def _state_dict_unwrap_hook(module, state_dict, prefix, local_metadata):
    # checkpoints hold plain tensors (or DTensors of plain tensors), never the subclass; they
    # alias the master weights, so loading into them in place (DCP) updates the model
    for name in mx_weight_names(module):
        key = prefix + name
        if key in state_dict:
            with torch.no_grad():
                state_dict[key] = _plain(state_dict[key])


def enable_quantized_all_gather(model: nn.Module, *, activation_checkpointing: bool = False, strict: bool = True,
                                world_size: int | None = None, block_size: int = 32, recipe=None) -> list[str]:
    """Make FSDP2 all-gather the GEMM weights of every mxtrain module in ``model`` quantized.

    Under an MX recipe each weight travels as MX bytes; under an FP8 recipe
    (Float8CurrentScaling, DelayedScaling, Float8BlockScaling) as FP8 codes, its
    scale(s) made by every rank from one batched amax all-reduce (or, for delayed
    scaling, from the module's state). ``enable_mx_all_gather`` is the same function.

    Call it **before** ``fully_shard`` (FSDP2 sets up its all-gather extension when it
    wraps a parameter) and before creating the optimizer (the weights become new
    ``nn.Parameter`` objects); non-mxtrain modules are left alone. Returns the
    names of the weights it converted.

    Args:
        activation_checkpointing: the forward of these modules is recomputed in backward
            (``torch.utils.checkpoint``), so the backward all-gather sends the rowwise plane as
            well as the columnwise one. The recompute must run under the same ``mx_autocast``
            (open it inside the checkpointed function).
        strict: raise when a weight cannot be sharded into whole MX blocks for
            ``world_size`` ranks (see :func:`check_shard_shape`); False leaves such
            weights as ordinary parameters (gathered in high precision) with a warning.
        world_size: ranks that will shard the weights (default: the default process
            group's size when initialized, else no shape check here; the all-gather checks again).
        block_size: the recipe block size to check shapes against.
        recipe: the recipe the model will train with, if known: its block size is checked
            (``block_size`` is ignored); an FP8 recipe needs no shape check (its codes are padded
            as FSDP pads, and a 128 x 128 block that spans two ranks gets its scale from an all-reduce).
    """

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if world_size is None and dist.is_available() and dist.is_initialized():
        world_size = dist.get_world_size()
    if isinstance(recipe, Float8Recipe):
        world_size = None
    elif isinstance(recipe, MXRecipeBase):
        block_size = recipe.block_size
    converted, skipped = [], []
    for mod_name, m in model.named_modules():
        names = mx_weight_names(m)
        if not names:
            continue
        for pname in names:
            p = getattr(m, pname, None)
            fqn = f"{mod_name}.{pname}".lstrip(".")
            if p is None or isinstance(p, MXAllGatherWeight):
                continue
            if isinstance(p, DTensor):
                raise RuntimeError(f"enable_mx_all_gather: {fqn} is already sharded (a DTensor); call "
                                   "enable_mx_all_gather(model) before fully_shard")
            if world_size is not None and world_size > 1:  # MX: whole blocks per rank
                try:
                    check_shard_shape(fqn, tuple(p.shape), world_size, (block_size,))
                except ValueError as e:
                    if strict:
                        raise
                    skipped.append(str(e))
                    continue
            gemm = pname.removesuffix("_weight") if pname != "weight" else ""
            info = _WeightInfo(name=fqn, activation_checkpointing=activation_checkpointing, gemm=gemm)
            setattr(m, pname, nn.Parameter(MXAllGatherWeight(p.detach(), info), requires_grad=p.requires_grad))
            converted.append(fqn)
        if not getattr(m, "_mx_all_gather_hook", False):
            m.register_state_dict_post_hook(_state_dict_unwrap_hook)
            m._mx_all_gather_hook = True
    if skipped:
        warnings.warn("enable_mx_all_gather: these weights keep high-precision all-gathers:\n" + "\n".join(skipped),
                      stacklevel=2)
    return converted


enable_mx_all_gather = enable_quantized_all_gather


def disable_mx_all_gather(model: nn.Module) -> list[str]:
    """Turn converted weights back into plain parameters (before ``fully_shard``; not on sharded models)."""
    from torch.distributed.tensor import DTensor

    restored = []
    for mod_name, m in model.named_modules():
        for pname in mx_weight_names(m):
            p = getattr(m, pname, None)
            if isinstance(p, DTensor):
                raise RuntimeError("disable_mx_all_gather: the model is already sharded by fully_shard")
            if isinstance(p, MXAllGatherWeight):
                setattr(m, pname, nn.Parameter(p._data, requires_grad=p.requires_grad))
                restored.append(f"{mod_name}.{pname}".lstrip("."))
    return restored


def set_block_prefetch(blocks, forward: int = 0, backward: int = 0) -> None:
    """FSDP2's explicit prefetching over a sequence of ``fully_shard`` blocks run in order: each block's
    forward gathers the next ``forward`` blocks' weights, its backward the ``backward`` blocks before it
    (nearest first). 0 leaves FSDP2's default for that pass. MX all-gathers send each phase's planes as
    without it (``tests/distributed``)."""
    for name, n in (("forward", forward), ("backward", backward)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"{name} prefetch must be a non-negative int (blocks), got {n!r}")
    blocks = list(blocks)
    for i, blk in enumerate(blocks):
        if forward:
            blk.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + forward])
        if backward:
            blk.set_modules_to_backward_prefetch(blocks[max(0, i - backward):i][::-1])
