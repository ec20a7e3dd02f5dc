"""Integration with other libraries' APIs: ``from mxtrain.compat import mx`` is microxcaling's ``mx``."""

from mxtrain.compat import mx

__all__ = ["mx"]
