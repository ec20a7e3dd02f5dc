"""Hugging Face families -> mxtrain (mxtrain.integrations.convert_hf) and back, on tiny random models.

For each family (Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2; ``transformers`` configs built
here, nothing downloaded): the converted model's fp32 logits equal the original's, its blocks are
the fused mxtrain modules, it trains under MXFP8 on the CPU, and a changed model saves with
``save_pretrained`` and reloads in ``transformers`` with equal logits. Options a model has that the
decoder does not reproduce are refused by name.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import mxtrain
from mxtrain.integrations import FAMILIES, convert_hf, family_config, to_hf_config, to_hf_model, to_hf_state_dict
from mxtrain.integrations.llama import LlamaConfig, MXLlamaForCausalLM, _causal_mask, from_hf_state_dict

transformers = pytest.importorskip("transformers")

VOCAB = 101
# initializer_range 0.1 (HF: 0.02): scores large enough that soft-capping and windows change the logits
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
              initializer_range=0.1)
# Each family with what sets it apart switched on; windows of 8 tokens so that 40-token inputs use them.
FAMILY_KW = {
    "llama": dict(attention_bias=True, mlp_bias=True),
    "mistral": dict(sliding_window=8),
    "qwen2": dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),  # layer 1 slides
    "qwen3": dict(attention_bias=True),
    "gemma": dict(),
    # caps small enough to bend these tiny models' scores and logits
    "gemma2": dict(sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=0.5,
                   final_logit_softcapping=0.3),
}
IDS = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))


@functools.lru_cache(maxsize=None)
def _cached_tiny_hf(family: str):
    return tiny_hf(family, cached=False)


def tiny_hf(family: str, cached: bool = True, **kw):
    """A random ``transformers`` causal LM of ``family`` with norms and biases away from their init
    (shared between tests unless ``kw`` changes its config: tests leave it unchanged)."""
    if cached and not kw:
        return _cached_tiny_hf(family)
    cfg = transformers.AutoConfig.for_model(family, **{**COMMON, **FAMILY_KW[family], **kw})
    torch.manual_seed(0)
    # eager attention: HF's reference semantics (transformers before 5.18 ran Gemma2 on sdpa by default,
    # which leaves out its attention-logit softcapping)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return getattr(out, "logits", out)


def test_families_listed():
    assert set(FAMILIES) == set(FAMILY_KW)


@pytest.mark.parametrize("family", FAMILY_KW)
def test_logits_match(family):
    hf = tiny_hf(family)
    model = convert_hf(hf)
    assert model.config.model_type == family
    ref = logits(hf)
    torch.testing.assert_close(logits(model), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    block = model.layers[0]
    assert isinstance(block.attn_qkv, mxtrain.LayerNormLinear) and block.attn_qkv.normalization == "RMSNorm"
    assert isinstance(block.attn_out, mxtrain.Linear) and isinstance(block.mlp, mxtrain.LayerNormMLP)
    assert block.mlp.activation == ("geglu_tanh" if family.startswith("gemma") else "swiglu")
    assert block.attn_qkv.zero_centered_gamma == block.mlp.zero_centered_gamma == family.startswith("gemma")
    assert all(p.data_ptr() != q.data_ptr() for p in model.parameters() for q in hf.parameters())  # copied


@pytest.mark.parametrize("family,option", [
    ("mistral", dict(sliding_window=None)),
    ("qwen2", dict(sliding_window=None, layer_types=None)),
    ("qwen2", dict(attention_bias=False, attention_out_bias=False)),
    ("qwen3", dict(qk_norm=False)),
    ("gemma", dict(scale_embeddings=False)),
    ("gemma", dict(zero_centered_norms=False)),
    ("gemma2", dict(attn_logit_softcapping=None)),
    ("gemma2", dict(final_logit_softcapping=None)),
    ("gemma2", dict(query_pre_attn_scalar=None)),
    ("gemma2", dict(sliding_window=None, layer_types=None)),
])
def test_each_option_matters(family, option):
    """Without the family's option the same weights give other logits: the match above is no accident."""
    hf = tiny_hf(family)
    model = convert_hf(hf)
    cfg = dataclasses.replace(model.config, **option)
    other = MXLlamaForCausalLM(cfg, rotary=model.rotary)
    state = {k: v for k, v in model.state_dict().items() if k in other.state_dict()}
    other.load_state_dict(state)
    assert (logits(other) - logits(hf)).abs().max() > 1e-3


@pytest.mark.parametrize("family", FAMILY_KW)
def test_save_pretrained_round_trip(family, tmp_path):
    """A changed (as if fine-tuned) converted model -> transformers -> save_pretrained -> reload: equal logits."""
    hf = tiny_hf(family)
    model = convert_hf(hf)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    assert to_hf_state_dict(model).keys() == hf.state_dict().keys()
    to_hf_model(model).save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True,
                                                                 attn_implementation="eager").eval()
    assert type(reloaded) is type(hf)
    want = logits(model)
    assert (want - logits(hf)).abs().max() > 1e-3  # the change shows
    torch.testing.assert_close(logits(reloaded), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("family", FAMILY_KW)
def test_random_init_family_to_hf(family):
    """family_config + reset_parameters: a model transformers builds from to_hf_config computes the same."""
    shape = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    cfg = dataclasses.replace(family_config(family, shape), **({"sliding_window": 8} if family in ("mistral", "gemma2")
                                                               else {}))
    torch.manual_seed(0)
    model = MXLlamaForCausalLM(cfg)
    model.reset_parameters()
    norms = [p for n, p in model.named_parameters() if n.endswith("norm.weight") and "q_norm" not in n
             and "k_norm" not in n]
    assert all(torch.all(p == (0.0 if family.startswith("gemma") else 1.0)) for p in norms)  # unit scale either way
    hf = to_hf_model(model)
    assert hf.config.model_type == family
    want = logits(model)
    torch.testing.assert_close(logits(hf), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert LlamaConfig.from_hf(hf.config) == cfg


@pytest.mark.parametrize("family", FAMILY_KW)
def test_mxfp8_forward_backward(family):
    model = convert_hf(tiny_hf(family))
    x, y = IDS[:, :-1], IDS[:, 1:]
    with torch.no_grad():
        hp = model(x, y).item()
    with mxtrain.mx_autocast(recipe=mxtrain.MXFP8Recipe()):
        loss = model(x, y)
    loss.backward()
    assert torch.isfinite(loss) and abs(loss.item() - hp) < 0.02 * hp, (loss.item(), hp)
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, n


def test_sliding_window_mask():
    m = _causal_mask(6, 3, "cpu")
    assert m[5].tolist() == [False, False, False, True, True, True]  # itself and the 2 before
    assert m[1].tolist() == [True, True, False, False, False, False]
    assert torch.equal(_causal_mask(6, None, "cpu"), torch.ones(6, 6, dtype=torch.bool).tril())


# ------------------------------------------------------------------------------------------- refusals

def test_unsupported_architecture_named():
    cfg = transformers.AutoConfig.for_model("olmo2", **COMMON)
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match="model_type 'olmo2' is not supported.*llama, mistral, qwen2"):
        convert_hf(hf)


@pytest.mark.parametrize("family,kw,match", [
    ("llama", dict(hidden_act="gelu_new"), "hidden_act='gelu_new'"),
    ("llama", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
     "rope_type 'dynamic'"),
    ("gemma", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ("qwen2", dict(attention_dropout=0.1), "attention_dropout"),
])
def test_unsupported_options_named(family, kw, match):
    hf = tiny_hf(family, **kw)
    with pytest.raises(ValueError, match=match):
        convert_hf(hf)


def test_unknown_parameters_refused():
    """A parameter the decoder has no place for (here Qwen3's q/k norms read as Qwen2) is named, not dropped."""
    hf = tiny_hf("qwen3")
    cfg = dataclasses.replace(LlamaConfig.from_hf(hf.config), model_type="qwen2", qk_norm=False)
    with pytest.raises(ValueError, match=r"no place for.*self_attn\.k_norm\.weight"):
        from_hf_state_dict(hf.state_dict(), cfg)


@pytest.mark.parametrize("family,option,match", [
    ("llama", dict(qk_norm=True), "qk_norm=True"),
    ("qwen2", dict(attention_out_bias=True), "attention_out_bias=True"),
    ("mistral", dict(zero_centered_norms=True), "zero_centered_norms=True"),
    ("gemma", dict(activation="geglu"), "activation='geglu'"),  # Gemma's config reads gelu as tanh gelu
])
def test_to_hf_config_refuses_what_the_family_cannot_express(family, option, match):
    if family == "gemma" and transformers.AutoConfig.for_model("gemma", hidden_act="gelu").hidden_act == "gelu":
        pytest.skip("this transformers keeps Gemma's hidden_act='gelu' as erf gelu (before 5.18): geglu fits")
    shape = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    with pytest.raises(ValueError, match=match):
        to_hf_config(dataclasses.replace(family_config(family, shape), **option))


def test_config_checks():
    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="sliding_window is None"):
        LlamaConfig(**shape, layer_types=("sliding_attention", "full_attention"))
    with pytest.raises(ValueError, match="per layer"):
        LlamaConfig(**shape, sliding_window=4, layer_types=("sliding_attention",))
    with pytest.raises(ValueError, match="gated one of"):
        LlamaConfig(**shape, activation="gelu")
    with pytest.raises(ValueError, match="unknown family"):
        family_config("phi3", LlamaConfig(**shape))


# ------------------------------------------------------------------------ examples/finetune_llm.py

def _finetune_script():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "examples" / "finetune_llm.py"
    spec = importlib.util.spec_from_file_location("finetune_llm_families", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SMOKE = ["--data", "random", "--seq-len", "16", "--batch-size", "2", "--eval-batches", "1", "--no-progress",
         "--no-initial-eval", "--steps", "2", "--recipe", "mxfp8"]


def test_finetune_example_random_family():
    ft = _finetune_script()
    base, _ = ft.load_base(ft.build_parser().parse_args(["--random-init", "--shape", "tiny", "--family", "gemma2",
                                                          "--data", "random"]), 0)
    assert base.config.model_type == "gemma2" and base.config.sandwich_norms
    res = ft.main(["--random-init", "--shape", "tiny", "--family", "qwen3"] + SMOKE)[0]
    assert len(res["history"]["train"]) == 2 and all(torch.isfinite(torch.tensor(res["history"]["train"])))


def test_finetune_example_local_transformers_dir(tmp_path):
    """--model DIR: a saved transformers model of another family is converted and trained."""
    tiny_hf("qwen2").save_pretrained(tmp_path)
    ft = _finetune_script()
    args = ft.build_parser().parse_args(["--model", str(tmp_path), "--data", "random", "--layers", "1"])
    base, tok = ft.load_base(args, 0)
    assert tok is None and base.config.model_type == "qwen2" and base.config.num_hidden_layers == 1
    assert base.config.sliding_window is None and base.config.layer_types is None  # only layer 1 slid
    res = ft.main(["--model", str(tmp_path)] + SMOKE)[0]
    assert all(torch.isfinite(torch.tensor(res["history"]["train"])))
