"""Bridges to models from other libraries: Hugging Face Llama-family decoders (Llama, SmolLM2, Mistral,
Qwen2/2.5, Qwen3, Gemma, Gemma 2) in :mod:`mxtrain.integrations.llama`.

``convert_hf(model)`` turns a ``transformers`` causal LM into the mxtrain model with fused blocks;
``to_hf_model`` / ``to_hf_state_dict`` map it back. Submodules import their third-party
dependency lazily, so importing this package costs nothing.
"""

from mxtrain.integrations.llama import (
    FAMILIES,
    convert_hf,
    family_config,
    to_hf_config,
    to_hf_model,
    to_hf_state_dict,
)

__all__ = ["FAMILIES", "convert_hf", "family_config", "to_hf_config", "to_hf_model", "to_hf_state_dict"]
