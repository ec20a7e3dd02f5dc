"""Runnable examples shipped with the package (``python -m mxtrain.examples.fashion_mnist``)."""
