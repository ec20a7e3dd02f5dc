"""Bridges to models from other libraries (Hugging Face Llama-family: :mod:`mxtrain.integrations.llama`).

Submodules import their third-party dependency lazily, so importing this package costs nothing.
"""
