"""GroupedLinear: the expert GEMMs of a Mixture-of-Experts layer, one weight per expert, under any recipe.

As Transformer Engine's ``GroupedLinear``: parameters ``weight0 .. weight{n-1}`` (and ``bias0 ..``);
``forward(x, m_splits)`` takes ``x [tokens, in_features]`` with the tokens already sorted by expert
and ``m_splits[i]`` tokens (zero allowed) for expert ``i``, which computes ``x_i W_i^T + b_i``.
Every expert computes what an ``mxtrain.Linear`` with its weight computes under the same recipe.

Casts. Where every block of a recipe's use stays inside one expert's rows, a tensor is cast for all
experts in one quantize call (one launch writing all of its planes) and each expert takes its rows of
the result: always the rowwise planes (blocks along K or N) of the input, the grad-output and the
stacked weights; the columnwise planes (blocks along tokens) when every expert's token count is a
multiple of the block (32 for MXFP8: pad each expert's tokens to it where the tokens are permuted, as
Megatron-LM's ``moe_router_padding_for_fp8`` and torchao's MoE token alignment do). Per-tensor FP8
scaling (current, delayed: one scale per expert tensor) casts a tensor of any size for all experts in
one grouped cast (each expert's segment with its own scale) where every count is a multiple of 16 (see
:func:`_grouped_float8`). Other counts, and DelayedScaling's first step, cast each expert alone, all its
uses from one read, exactly as a loop of ``mxtrain.Linear`` does: padding a copy of the stacked tensor
would cost more passes over it than the per-expert casts.

GEMMs. MX recipes with bf16 activations on CUDA run each pass as one grouped bf16 GEMM
(``torch.nn.functional.grouped_mm``) of the dequantized operands (written as bf16 values by the casts
where the operand is used at once), as ``mx_gemm`` does on Hopper, where all experts were cast at
once; everything else (CPU, ragged counts, FP8 recipes: ``scaled_mm`` / the 128-block kernel per
expert) runs ``mx_linear_forward`` / ``mx_linear_backward`` per expert, each GEMM writing its rows of one
output (no concatenation).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from mxtrain import config
from mxtrain.autocast import get_recipe
from mxtrain.kernels import registry
from mxtrain.kernels.calls import GroupedFloat8CastCall
from mxtrain.kernels.dispatch import dequantize
from mxtrain.modules._common import (_WEIGHT_CASTS, apply_module_fn, check_input, check_mx_operands,
                                     empty_batch_backward, empty_batch_forward, release_mx_operands)
from mxtrain.modules._recipe_state import RecipeStateMixin
from mxtrain.modules.amax_hints import row_maxima
from mxtrain.modules.linear import _functional_quantizers, init_linear_, mx_linear_backward, mx_linear_forward
from mxtrain.quantization import MXTensor
from mxtrain.quantization.float8 import Float8Tensor
from mxtrain.recipes.float8 import Float8RoleSpec

__all__ = ["GroupedLinear", "mx_grouped_linear"]

# "auto": the grouped bf16 GEMM on CUDA (MX recipes, bf16 activations); "0": never (per-expert GEMMs);
# "1": also off CUDA (tests run the grouped path on the CPU this way)
_grouped_mm_fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
_GROUPED_MM_FAILED: set = set()


def _row_unit(spec, axis: int) -> int | None:
    """Rows of the stacked tensor one block of this use spans (1: blocks inside a row); None where one
    scale covers a whole expert tensor (per-tensor FP8, whole-axis MX blocks along tokens)."""
    if spec is None or spec.fmt is None:
        return 1
    if isinstance(spec, Float8RoleSpec):
        return None if spec.block is None else spec.block[1 if axis == 0 else 0]
    return 1 if axis != 0 else (spec.block_size or None)


class _Pending:
    """An expert's cast not made yet: made when its operands are first asked for (``_Operands.expert``)."""

    __slots__ = ("make",)

    def __init__(self, make):
        self.make = make


class _Operands:
    """The operands of every expert for a list of (spec, axis) uses.

    ``full[u]``: use ``u``'s operand of the whole stacked (for padded uses: padded) tensor, and
    ``ends[u]`` the experts' end rows in it (for a grouped GEMM); None when cast per expert.
    ``expert(e)``: expert ``e``'s own operands, as its quantizer would make them of its rows (a deferred
    per-expert cast, ``grouped_operands(defer=True)``, is made then, once).
    """

    def __init__(self, per_expert=None, full=None, starts=None, ends=None, splits=None):
        self.per_expert, self.full, self.starts, self.ends, self.splits = per_expert, full, starts, ends, splits

    def expert(self, e: int) -> list:
        if self.per_expert is not None:
            got = self.per_expert[e]
            if type(got) is _Pending:
                got = self.per_expert[e] = got.make()
            return got
        return [_rows(op, self.starts[u][e], self.splits[e]) for u, op in enumerate(self.full)]


def grouped_operands(stacked, parts, splits: list[int], quantizer_of, rowwise: bool, columnwise: bool,
                     at_once: bool = False, rank_invariant: bool = False, defer: bool = False) -> _Operands:
    """Cast the experts' row blocks of a stacked 2-D tensor for their rowwise / columnwise uses.

    ``stacked()`` returns the tensor with every expert's rows in order (``splits`` rows each),
    ``parts`` each expert's rows alone, ``quantizer_of(e)`` expert ``e``'s quantizer (None: high
    precision, each use gets the tensor itself). Where every block of
    every use stays inside one expert's rows, one quantize call casts all experts (all uses from one
    read); else each expert is cast alone, all its uses in one call, as ``mxtrain.Linear`` casts it
    (a zero-padded copy would cost more passes over the tensor than the per-expert casts; see module doc).
    ``rank_invariant``: the tensor's shape and splits are the same on every rank (the weights; not the tokens,
    whose counts are each rank's own): only such a tensor may choose its casts' collectives by its splits.
    Row maxima recorded with the tensor ``stacked()`` returns (``mxtrain.modules.amax_hints``: the tokens a
    kernel wrote) serve its per-tensor FP8 casts' amaxes.
    ``defer``: where each expert is cast alone, cast it when its operands are first asked for (the forward's
    GEMM loop then alternates cast and GEMM: the GPU multiplies expert ``e`` while the host issues the cast of
    ``e + 1``, instead of waiting for every cast's issue first); only where the casts have no effect beyond
    their result (no amax all-reduce, no DelayedScaling record, no random draws), so that an expert never asked for (no tokens)
    changes nothing by going uncast.
    """
    def cast(e, t):
        q = quantizer_of(e)
        return [t, t] if q is None else list(q.quantize(t, rowwise, columnwise, at_once))

    grouped = _grouped_float8(stacked, parts, splits, quantizer_of, rowwise, columnwise, rank_invariant)
    if grouped is not None:
        return grouped
    q0 = quantizer_of(0)
    uses = [(None, 1), (None, 0)] if q0 is None else [(q0.row_spec if rowwise else None, 1),
                                                     (q0.col_spec if columnwise else None, 0)]
    units = [_row_unit(spec, axis) for spec, axis in uses]
    if (None in units or any(n % unit for unit in units for n in splits)
            or any(hasattr(p, "mx_gathered_plane") for p in parts)):
        # an expert without tokens casts nothing (as mxtrain.Linear given no tokens): its entry is None; where its
        # casts all-reduce their amax, it joins those collectives (another rank may have tokens for it: unmatched
        # collectives would pair wrongly or hang)
        per_expert = []
        defer = defer and not _reduces_amax(uses) and not _cast_has_effects(uses)  # casts that make only their result
        for e, (p, n) in enumerate(zip(parts, splits)):
            if n and defer:
                per_expert.append(_Pending(functools.partial(cast, e, p)))
            elif n:
                per_expert.append(cast(e, p))
            else:
                if not hasattr(p, "mx_gathered_plane") and _reduces_amax(uses):
                    # the same casts, of one zero row: the same collectives as a rank with tokens for this expert
                    # makes, in the same order; an amax of 0 changes no MAX. DelayedScaling records it: an expert
                    # that no rank gave tokens in its first steps then leaves the fresh-slot start with a history
                    # of zeros (scale 1, as Transformer Engine starts) and recovers after one step with tokens
                    cast(e, p.new_zeros(1, p.shape[-1]))
                per_expert.append(None)
        return _Operands(splits=splits, per_expert=per_expert)
    starts = _starts(splits)
    full = cast(0, stacked())
    ends = [s + n for s, n in zip(starts, splits)]
    return _Operands(full=full, starts=[starts] * len(uses), ends=[ends] * len(uses), splits=splits)


# Per-tensor FP8 (current, delayed): every tensor whose experts' token counts are multiples of 16 is cast for all
# experts in one grouped cast, whatever its size. Measured on an H100 at the Mixtral-8x7B shape (bench_grouped_cast,
# per expert against grouped, ms): x [16544, 4096] 1.29 / 0.31, the SwiGLU output [16544, 14336] 1.29 / 0.69, its
# gradient [16544, 28672] without recorded maxima 1.29 / 1.28, the stacked weights [8, 28672, 4096] 2.18 / 2.16 and
# [8, 4096, 14336] 1.57 / 1.16; the layer's step (bench_moe, aligned, Float8CurrentScaling) 19.9-20.0 ms against
# 21.1-21.7 with the larger tensors cast per expert (the forward's host issue 11 against 14-15 ms).


def _float8_key(spec):
    """What every expert's spec of a use must share for one grouped cast to make all their operands (DelayedScaling:
    the module's one state; each expert has its own slots in it)."""
    return (spec.fmt, spec.scaling, spec.block, spec.power_of_2_scales, spec.amax_epsilon,
            id(spec.amax_reduction_group), id(spec.state))


def _delayed_scales(splits: list[int], slots: list[str], state, fmt: str, device) -> torch.Tensor | None:
    """DelayedScaling: the experts' scales ``[E]`` from their slots, as each expert's cast would take them; None where
    a slot of an expert with tokens has no history yet (its first scale comes from its own rows' amax: the
    per-expert casts make it)."""
    if state is None or any(n and state.fresh(slot) for slot, n in zip(slots, splits)):
        return None
    if hasattr(state, "scales_for"):  # the state itself (not a frozen view of it): every scale in one copy
        return state.scales_for(slots, fmt, device)
    return torch.stack([state.scale_for(slot, fmt, device).reshape(()) for slot in slots])


def _grouped_float8(stacked, parts, splits: list[int], quantizer_of, rowwise: bool, columnwise: bool,
                    rank_invariant: bool):
    """Per-tensor FP8 scaling: every expert's operands from one grouped cast (current scaling: an amax pass and one
    cast launch over all experts, each expert's segment with its own scale; DelayedScaling: one cast launch with
    each expert's scale from its slot, its amax recorded there after: ``grouped_float8_cast``), bit for bit what
    each expert's quantizer makes of its rows; None where the per-expert casts run instead.

    Taken for tensors of any size (current scaling of a tensor whose row maxima a kernel recorded,
    ``mxtrain.modules.amax_hints``, reads those instead of the tensor for its amaxes), where every expert's token
    count is a multiple of 16 (tokens padded per expert, as FP8 MoE training pads
    them for the FP8 GEMMs' alignment: Megatron-LM's ``moe_router_padding_for_fp8``): with ragged counts the
    kernel's transposed writes ran 4x slower than with aligned ones on an H100, slower than the per-expert
    casts. Not taken for block scales, for DelayedScaling slots without a history yet (their first scale comes from
    their own rows), for tensors that are not ``rank_invariant`` (the tokens) under an amax reduction group (each
    rank's counts would choose its collectives: one all-reduce of all experts' amaxes on one rank could meet
    per-expert ones on another), while compiling,
    for FSDP2-gathered weights or weights inside ``weight_cast_cache`` (its cache serves them), or where no
    Triton kernel runs (the CPU without the interpreter)."""
    q0 = quantizer_of(0)
    if q0 is None or not q0.float8 or not any(splits) or torch.compiler.is_compiling():
        return None
    uses = [a for a, want, quantized in ((1, rowwise, q0.row_quantized), (0, columnwise, q0.col_quantized))
            if want and quantized]
    if not uses or any(n % 16 for n in splits):
        return None
    spec = q0.role(uses[0])
    if spec.scaling not in ("current", "delayed") or spec.block is not None:
        return None
    delayed = spec.scaling == "delayed"
    group = getattr(spec.state, "amax_reduction_group", None) if delayed else spec.amax_reduction_group
    if group is not None and not rank_invariant:
        # each rank's token counts would choose its collectives: one all-reduce of all experts' amaxes here could
        # meet per-expert all-reduces on a rank whose counts are ragged. Only the weights are cast grouped
        return None
    uniform = all(n == splits[0] for n in splits)
    key = _float8_key(spec)
    if any(_float8_key(quantizer_of(e).role(a)) != key for e in range(len(splits)) for a in uses):
        return None
    if any(hasattr(p, "mx_gathered_plane") for p in parts) or (_WEIGHT_CASTS.depth and isinstance(parts[0], nn.Parameter)):
        return None
    p0 = parts[0]
    if p0.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    slots = [quantizer_of(e).role(uses[0]).slot for e in range(len(splits))]
    scale = _delayed_scales(splits, slots, spec.state, spec.fmt, p0.device) if delayed else None
    if delayed and scale is None:
        return None
    x = stacked()  # (weights that do not share one buffer are concatenated here: only once the path is taken)
    if x.stride(1) != 1:
        return None
    maxima = None if delayed else row_maxima(x)  # (a stacked copy or view of the weights has none)
    call = GroupedFloat8CastCall(x, None if uniform else _offsets(list(itertools.accumulate(splits)), x.device),
                                 splits[0] if uniform else None, len(splits), spec.fmt, 1 in uses, 0 in uses, "expert",
                                 scale, bool(spec.power_of_2_scales), float(spec.amax_epsilon),
                                 None if delayed else spec.amax_reduction_group,
                                 segment_multiple=math.gcd(*splits), row_amax=maxima)
    try:
        if registry.select("grouped_float8_cast", call, x.device).backend != "triton":
            return None
    except (ValueError, RuntimeError):  # the op is not registered (no Triton), or nothing runs here
        return None
    q8 = registry.run("grouped_float8_cast", call, x.device)
    per_expert = []
    if delayed:  # as each expert's cast records the amax of its rows (experts without tokens record nothing)
        if all(splits) and hasattr(spec.state, "record_many"):
            spec.state.record_many(slots, q8.amax)
        else:
            for e, n in enumerate(splits):
                if n:
                    spec.state.record(slots[e], q8.amax[e])
    for e, got in enumerate(q8.experts(splits, tuple(uses))):
        if got is None:  # no tokens: nothing cast, nothing recorded (an amax all-reduce was one for all experts)
            per_expert.append(None)
            continue
        ops = [parts[e] if rowwise else None, parts[e] if columnwise else None]  # high-precision uses: the rows
        for a in uses:
            ops[1 - a] = got[a]
        per_expert.append(ops)
    return _Operands(splits=splits, per_expert=per_expert)


def _reduces_amax(uses) -> bool:
    """Whether the per-tensor FP8 casts of ``uses`` take part in amax all-reduces across ranks (current scaling
    with an ``amax_reduction_group``; DelayedScaling with one: a fresh slot's first cast, and the update that
    follows what every rank recorded)."""
    for spec, _ in uses:
        if not isinstance(spec, Float8RoleSpec) or spec.fmt is None or spec.block is not None:
            continue
        if spec.scaling == "current" and spec.amax_reduction_group is not None:
            return True
        if spec.scaling == "delayed" and spec.state is not None and spec.state.amax_reduction_group is not None:
            return True
    return False


def _cast_has_effects(uses) -> bool:
    """Whether the casts of ``uses`` do more than make their result: record their amaxes (DelayedScaling) or draw
    random numbers (stochastic rounding: the order of the draws, and whether an expert without tokens draws, must
    not follow the routing)."""
    return any(spec is not None and spec.fmt is not None
               and ((isinstance(spec, Float8RoleSpec) and spec.scaling == "delayed")
                    or getattr(spec, "rounding", None) == "stochastic")
               for spec, _ in uses)


def _rows(op, start: int, n: int):
    """Rows ``[start, start + n)`` of an operand of a stacked tensor: the operand of those rows alone
    (``start`` is a multiple of every block length along the rows)."""
    if op is None:  # a use not asked for
        return None
    if isinstance(op, torch.Tensor):
        return op[start:start + n]
    if isinstance(op, MXTensor):
        planes = tuple(_mx_plane_rows(p, start, n, op.block_size) for p in op.planes)
        values = tuple((a, v[start:start + n]) for a, v in op.values)
        return MXTensor._unchecked(planes, op.fmt, op.block_size, (n, *op.shape[1:]), op.dtype, op.scale_mode,
                                   op.rounding, op.whole_axis, values)
    if isinstance(op, Float8Tensor):
        planes = tuple(_float8_plane_rows(p, start, n) for p in op.planes)
        return dataclasses.replace(op, planes=planes, shape=(n, *op.shape[1:]))
    raise TypeError(f"not a GEMM operand: {type(op).__name__}")


def _mx_plane_rows(p, start: int, n: int, block_size: int):
    if p.axis != 0:  # blocks along the row: rows are rows of data and scale
        return dataclasses.replace(p, data=p.data[start:start + n], scale=p.scale[start:start + n])
    per_block = p.data.shape[-1] // p.scale.shape[-1]  # bytes of one block's codes (packed or not)
    b0, b1 = start // block_size, -(-(start + n) // block_size)
    return dataclasses.replace(p, data=p.data[:, b0 * per_block:b1 * per_block].contiguous(),
                               scale=p.scale[:, b0:b1].contiguous())


def _float8_plane_rows(p, start: int, n: int):
    s = p.scale_inv
    if p.axis != 0:
        if p.block is not None:
            s = s[start // p.block[0]:-(-(start + n) // p.block[0])]
        return dataclasses.replace(p, data=p.data[start:start + n], scale_inv=s)
    if p.block is not None:
        s = s[:, start // p.block[1]:-(-(start + n) // p.block[1])].contiguous()
    return dataclasses.replace(p, data=p.data[:, start:start + n].contiguous(), scale_inv=s)


def _stack_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The 2-D tensors one under the other: a view where they lie so in one storage (as GroupedLinear
    allocates its weights), else a copy."""
    t0 = tensors[0]
    rows, step = t0.shape[0], t0.numel()
    if all(t.is_contiguous() and t.dtype == t0.dtype and t.shape == t0.shape and t.device == t0.device
           and t.untyped_storage().data_ptr() == t0.untyped_storage().data_ptr()
           and t.storage_offset() == t0.storage_offset() + i * step for i, t in enumerate(tensors)):
        return t0.as_strided((rows * len(tensors), t0.shape[1]), (t0.shape[1], 1))
    return torch.cat(tensors)


def _grouped_gemm_ok(x2d, specs, dims) -> bool:
    """Whether this pass runs as one grouped bf16 GEMM: MX operands (values exact in bf16), bf16
    activations, rows 16-byte aligned, a grouped GEMM in this torch and device."""
    if config.current().grouped_mm == "0" or _grouped_mm_fn is None or x2d.dtype != torch.bfloat16:
        return False
    if config.current().grouped_mm != "1" and not x2d.is_cuda:
        return False
    if (x2d.device.type, x2d.device.index) in _GROUPED_MM_FAILED:
        return False
    return all(d % 8 == 0 for d in dims) and all(
        s is not None and not isinstance(s, Float8RoleSpec) and s.fmt is not None for s in specs)


# CUDA group ends recently copied, by (ends, device, stream): a MoE step casts and multiplies the tokens, the SwiGLU
# output, their gradients by the same counts, four copies of one list (each ~0.1 ms of host time on an H100 host)
_ENDS: dict = {}
_ENDS_KEPT = 16


def _offsets(ends: list[int], device: torch.device) -> torch.Tensor:
    """The grouped GEMM's (and grouped cast's) int32 group ends on ``device``; on CUDA copied from pinned
    memory without blocking (a pageable copy would wait for every kernel queued before it: the host then
    stops feeding the GPU), and the last few kept for later calls with the same ends on the same stream (read
    only, never written; a call on another stream makes its own copy, ordered on that stream)."""
    if device.type != "cuda":
        return torch.tensor(ends, dtype=torch.int32).to(device)
    keep = not torch.compiler.is_compiling() and not torch.cuda.is_current_stream_capturing()
    key = (tuple(ends), device, torch.cuda.current_stream(device).stream_id) if keep else None
    hit = _ENDS.get(key) if keep else None
    if hit is not None:
        return hit
    t = torch.tensor(ends, dtype=torch.int32).pin_memory().to(device, non_blocking=True)
    if keep:
        if len(_ENDS) >= _ENDS_KEPT:
            _ENDS.pop(next(iter(_ENDS)))
        _ENDS[key] = t
    return t


def _grouped_mm(a, b, offs):
    """``F.grouped_mm`` (bf16 result: the fp32 accumulation rounded once, as the per-expert bf16 GEMM
    rounds it); None (and per-expert GEMMs from then on) where it raises."""
    try:
        return _grouped_mm_fn(a, b, offs=offs)
    except RuntimeError as err:
        device = a.device
        _GROUPED_MM_FAILED.add((device.type, device.index))
        warnings.warn(f"GroupedLinear: the grouped GEMM failed on {device} ({err}); running per-expert GEMMs "
                      "(MXTRAIN_GROUPED_MM=0 chooses them from the start)", RuntimeWarning, stacklevel=3)
        return None


def _expert_stack(w: torch.Tensor, num_gemms: int, rows: int) -> torch.Tensor:
    """``[num_gemms, rows, K]`` view of stacked weight values (each expert's rows padded or not)."""
    return w.view(num_gemms, w.shape[0] // num_gemms, w.shape[1])[:, :rows]


def _values(op, axis: int) -> torch.Tensor:
    """bf16 values of an MX operand's plane in the logical layout (exact: every MX value is a bf16 value)."""
    return dequantize(op, torch.bfloat16, axis)


class _GroupedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, splits, quantizers, num_gemms, *params):
        # quantizers: each expert's GemmQuantizers (one recipe: expert 0's specs stand for all of them)
        weights, biases = params[:num_gemms], (params[num_gemms:] or (None,) * num_gemms)
        q0 = quantizers[0]
        if x.shape[0] == 0 and not _reduces_amax([(q.row_spec, 1) for q in (q0.input, q0.weight, q0.grad_output)]):
            # no token for any expert (an expert-parallel rank that got none): the empty result and zero weight
            # gradients, nothing cast, as mxtrain.Linear gives them. (Casts that all-reduce their amax still run:
            # the other ranks' casts wait for this rank's)
            return empty_batch_forward(ctx, (x, None, None, None, *params), x.new_empty(0, weights[0].shape[0]))
        needs_wgrad = any(ctx.needs_input_grad[4:4 + num_gemms])
        needs_dgrad = ctx.needs_input_grad[0]
        n_out = weights[0].shape[0]
        # the weights first: their casts are the larger (the GPU starts on them while the host issues the rest);
        # those cast per expert are deferred to the GEMM loop (cast e, GEMM e, cast e + 1, ...)
        keep_dgrad = needs_dgrad and q0.weight.keeps_dgrad_plane()  # FP8: the dgrad plane from forward's cast
        w_ops = grouped_operands(lambda: _stack_rows(list(weights)), weights, [n_out] * num_gemms,
                                 lambda e: quantizers[e].weight, True, keep_dgrad, rank_invariant=True, defer=True)
        x_ops = grouped_operands(lambda: x, x.split(splits), splits, lambda e: quantizers[e].input, True,
                                 needs_wgrad)
        y = None
        specs = [q0.input.row_spec, q0.weight.row_spec]  # fprop_input, fprop_weight
        if x_ops.full is not None and w_ops.full is not None and _grouped_gemm_ok(x, specs, (x.shape[1], n_out)):
            w = _expert_stack(_values(w_ops.full[0], 1), num_gemms, n_out)
            ctx.offs = _offsets(x_ops.ends[0], x.device)
            y = _grouped_mm(_values(x_ops.full[0], 1), w.transpose(1, 2), ctx.offs)
            if y is not None:
                if biases[0] is not None:
                    rows = torch.repeat_interleave(torch.arange(num_gemms, device=x.device),
                                                   torch.tensor(splits, device=x.device), output_size=x.shape[0])
                    y = y.float() + torch.stack([b.float() for b in biases])[rows]
                y = y.to(x.dtype)
        if y is None:  # per-expert GEMMs, each writing its rows of y
            y = x.new_empty(x.shape[0], n_out)
            for e, (start, n) in enumerate(zip(_starts(splits), splits)):
                if n:
                    mx_linear_forward(x, weights[e], biases[e], quantizers[e], needs_wgrad, needs_dgrad,
                                      x_operands=x_ops.expert(e), w_operands=_pair(w_ops.expert(e)),
                                      out=y[start:start + n])
        # the wgrad input planes (snapshots) stay on ctx; a high-precision one is the input itself,
        # saved so that autograd version-checks it (as mxtrain.Linear does)
        x_hp = x if (needs_wgrad and isinstance(_first(x_ops, 1), torch.Tensor)) else None
        ctx.save_for_backward(x_hp, *weights)
        ctx.x_ops = None if x_hp is not None else x_ops
        ctx.w_ops, ctx.quantizers, ctx.splits = w_ops, quantizers, splits
        ctx.has_bias = biases[0] is not None
        ctx.dtypes = (x.dtype, [w.dtype for w in weights], [None if b is None else b.dtype for b in biases])
        return y

    @staticmethod
    def backward(ctx, dy):
        if (grads := empty_batch_backward(ctx)) is not None:
            return grads
        check_mx_operands(ctx, "GroupedLinear")
        x_hp, *weights = ctx.saved_tensors
        num_gemms, splits, quantizers = len(weights), ctx.splits, ctx.quantizers
        need_dx = ctx.needs_input_grad[0]
        need_w = ctx.needs_input_grad[4:4 + num_gemms]
        need_b = ctx.needs_input_grad[4 + num_gemms:] if ctx.has_bias else (False,) * num_gemms
        x_ops = ctx.x_ops if x_hp is None else grouped_operands(
            lambda: x_hp, x_hp.split(splits), splits, lambda e: None, True, True)
        dy = dy.contiguous()
        dy_ops = grouped_operands(lambda: dy, dy.split(splits), splits, lambda e: quantizers[e].grad_output,
                                  need_dx, any(need_w), at_once=True)
        w_cols = ctx.w_ops
        if need_dx and _first(w_cols, 1) is None:  # MX: the dgrad plane is cast in backward, used at once
            # (on CUDA the cast writes its bf16 values, as it does for mxtrain.Linear's weight parameter)
            w_cols = grouped_operands(lambda: _stack_rows(weights), weights, [weights[0].shape[0]] * num_gemms,
                                      lambda e: quantizers[e].weight, False, True, at_once=True, rank_invariant=True)
        out = _grouped_backward(ctx, dy, x_ops, dy_ops, w_cols, weights, need_dx, need_w, need_b)
        if out is None:
            out = _per_expert_backward(ctx, dy, x_ops, dy_ops, w_cols, weights, need_dx, need_w, need_b)
        dx, dws, dbs = out
        release_mx_operands(ctx, "x_ops", "w_ops")
        return (dx, None, None, None, *dws, *(dbs if ctx.has_bias else ()))


def _pair(ops: list) -> tuple:
    return ops[0], (ops[1] if len(ops) > 1 else None)


def _first(ops: _Operands, use: int):
    """The first expert's operand for ``use`` (every expert's is of the same kind), None if there is no such
    use (or no expert has tokens)."""
    made = [] if ops.per_expert is None else [g for g in ops.per_expert if g is not None and type(g) is not _Pending]
    # (an expert's deferred cast is made here only when none was made yet)
    got = made[0] if made else next((g for g in map(ops.expert, range(len(ops.splits))) if g is not None), [])
    return got[use] if use < len(got) else None


def _per_expert_backward(ctx, dy, x_ops, dy_ops, w_cols, weights, need_dx, need_w, need_b):
    x_dtype, w_dtypes, b_dtypes = ctx.dtypes
    dws, dbs = [], []
    # each expert's dgrad GEMM writes its rows of dx
    dx = dy.new_empty(dy.shape[0], weights[0].shape[1], dtype=x_dtype) if need_dx else None
    for e, (start, n) in enumerate(zip(_starts(ctx.splits), ctx.splits)):
        w = weights[e]
        if n == 0:  # no tokens: zero gradients, no GEMM
            dws.append(torch.zeros_like(w) if need_w[e] else None)
            dbs.append(torch.zeros(w.shape[0], dtype=b_dtypes[e], device=w.device) if need_b[e] else None)
            continue
        _, dw, db = mx_linear_backward(dy[start:start + n], x_ops.expert(e)[1], w, ctx.quantizers[e],
                                       need_dx, need_w[e], x_dtype, w_dtypes[e],
                                       w_col=_pair(w_cols.expert(e))[1] if need_dx else None,
                                       bias_dtype=b_dtypes[e] if need_b[e] else None,
                                       dy_operands=tuple(dy_ops.expert(e)),
                                       dx_out=dx[start:start + n] if need_dx else None)
        dws.append(dw)
        dbs.append(db)
    return dx, dws, dbs


def _starts(splits: list[int]) -> list[int]:
    """Each expert's first row in the stacked tokens."""
    return list(itertools.accumulate(splits[:-1], initial=0))


def _grouped_backward(ctx, dy, x_ops, dy_ops, w_cols, weights, need_dx, need_w, need_b):
    """dgrad and wgrad as one grouped GEMM each (see :func:`_grouped_gemm_ok`); None where they do not apply."""
    q0, num_gemms = ctx.quantizers[0], len(weights)
    n_out, n_in = weights[0].shape
    if dy_ops.full is None or x_ops.full is None or (need_dx and w_cols.full is None):
        return None
    # dgrad_grad_output, dgrad_weight; wgrad_grad_output, wgrad_input
    specs = ([q0.grad_output.row_spec, q0.weight.col_spec] if need_dx else []) + (
        [q0.grad_output.col_spec, q0.input.col_spec] if any(need_w) else [])
    if not _grouped_gemm_ok(dy, specs, (n_in, n_out)):
        return None
    dx = dw = None
    offs = getattr(ctx, "offs", None)
    if offs is None:
        offs = _offsets(dy_ops.ends[0], dy.device)
    if need_dx:
        w = _expert_stack(_values(w_cols.full[1], 0), num_gemms, n_out)
        dx = _grouped_mm(_values(dy_ops.full[0], 1), w, offs)
        if dx is None:
            return None
        dx = dx.to(ctx.dtypes[0])
    if any(need_w):
        dw = _grouped_mm(_values(dy_ops.full[1], 0).t(), _values(x_ops.full[1], 0), offs)
        if dw is None:
            return None
    dws = [dw[e].to(ctx.dtypes[1][e]) if need_w[e] else None for e in range(num_gemms)]
    dbs = [s.sum(0, dtype=torch.float32).to(ctx.dtypes[2][e]) if need_b[e] else None
           for e, s in enumerate(dy.split(ctx.splits))]
    return dx, dws, dbs


def _check_splits(m_splits, num_gemms: int, tokens: int) -> list[int]:
    if isinstance(m_splits, torch.Tensor):
        m_splits = m_splits.tolist()
    try:
        splits = [int(n) for n in m_splits]
        if any(n != m for n, m in zip(splits, m_splits)):
            raise TypeError
    except (TypeError, ValueError):
        raise TypeError(f"m_splits must be a list of {num_gemms} non-negative ints (tokens per expert), "
                        f"got {m_splits!r}") from None
    if len(splits) != num_gemms or any(n < 0 for n in splits):
        raise ValueError(f"m_splits must hold {num_gemms} non-negative token counts (one per expert), got {splits}")
    if sum(splits) != tokens:
        raise ValueError(f"m_splits sums to {sum(splits)} but the input has {tokens} tokens (rows); the tokens "
                         "must be sorted by expert and counted exactly once")
    return splits


def mx_grouped_linear(x, m_splits, weights, biases=None) -> torch.Tensor:
    """Functional form: expert ``i`` computes ``x_i W_i^T + b_i`` on its ``m_splits[i]`` rows of ``x [tokens, in]``
    (MX / FP8 GEMMs under ``mx_autocast``, as :class:`GroupedLinear`)."""
    weights = list(weights)
    check_input(x, weights[0].shape[1], "mx_grouped_linear")
    if x.ndim != 2:
        raise ValueError(f"mx_grouped_linear expects a 2-D input [tokens, {weights[0].shape[1]}], got {list(x.shape)}")
    splits = _check_splits(m_splits, len(weights), x.shape[0])
    recipe = get_recipe()
    if recipe is None:
        ys = [F.linear(xe, w, None if biases is None else biases[e]) for e, (xe, w) in enumerate(
            zip(x.split(splits), weights))]
        return torch.cat(ys)
    # no module keeps them (nor a DelayedScaling state, which the cast then asks for): the experts share
    # mx_linear's one-GEMM quantizers
    q = _functional_quantizers(recipe, x.device)[""]
    return _GroupedLinearFn.apply(x, splits, (q,) * len(weights), len(weights), *weights, *(biases or ()))


class GroupedLinear(RecipeStateMixin, nn.Module):
    """``num_gemms`` linear layers applied to consecutive row blocks of one input (MoE experts).

    Parameters ``weight{i} [out_features, in_features]`` and ``bias{i}`` (Transformer Engine's names), each
    initialised as ``nn.Linear``'s. The weights are allocated in one buffer, so that the casts (and the
    grouped GEMM) read all of them without a copy; they are ordinary parameters all the same.
    ``forward(x, m_splits)``: ``x [tokens, in_features]`` sorted by expert, ``m_splits`` the token count of
    each expert (a list of ints, or a 1-D tensor, zeros allowed); returns ``[tokens, out_features]``.
    Under DelayedScaling each expert's tensors have their own amax histories (slots ``expert{i}.input``
    ...), kept in this module's ``_extra_state``.
    """

    def __init__(self, num_gemms: int, in_features: int, out_features: int, bias: bool = True,
                 device=None, dtype=None) -> None:
        super().__init__()
        for name, v in (("num_gemms", num_gemms), ("in_features", in_features), ("out_features", out_features)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"GroupedLinear {name} must be a positive int, got {v!r}")
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.use_bias = bool(bias)
        kw = {"device": device, "dtype": dtype}
        weights = torch.empty(num_gemms, out_features, in_features, **kw)
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", nn.Parameter(weights[i]))
            self.register_parameter(f"bias{i}", nn.Parameter(torch.empty(out_features, **kw)) if bias else None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for i in range(self.num_gemms):
            init_linear_(getattr(self, f"weight{i}").data, None if not self.use_bias else getattr(self, f"bias{i}").data)

    @property
    def weights(self) -> list[nn.Parameter]:
        return [getattr(self, f"weight{i}") for i in range(self.num_gemms)]

    @property
    def biases(self) -> list[nn.Parameter] | None:
        return [getattr(self, f"bias{i}") for i in range(self.num_gemms)] if self.use_bias else None

    def forward(self, x: torch.Tensor, m_splits) -> torch.Tensor:
        check_input(x, self.in_features, "GroupedLinear")
        if x.ndim != 2:
            raise ValueError(f"GroupedLinear expects a 2-D input [tokens, {self.in_features}] sorted by expert, "
                             f"got {list(x.shape)}")
        splits = _check_splits(m_splits, self.num_gemms, x.shape[0])
        recipe = get_recipe()
        if recipe is None:
            return mx_grouped_linear(x, splits, self.weights, self.biases)
        quantizers = self.forward_quantizers(recipe, x.device)
        return apply_module_fn(_GroupedLinearFn, self.weights, x, splits,
                               tuple(quantizers[f"expert{e}"] for e in range(self.num_gemms)), self.num_gemms,
                               *self.weights, *(self.biases or ()))

    def extra_repr(self) -> str:
        return (f"num_gemms={self.num_gemms}, in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.use_bias}")
