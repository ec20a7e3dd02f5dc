"""microxcaling's MX ``LSTM`` is not reproduced by mxtrain."""

__all__ = ["LSTM"]


class LSTM:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("mxtrain.compat.mx does not provide microxcaling's LSTM; build the cell from "
                                  "mx.Linear, mx.sigmoid, mx.tanh and mx.simd_* ops")
