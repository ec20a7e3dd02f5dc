"""Distributed training with torch's FSDP2 (``fully_shard``) and ``torchrun``: MX weight all-gathers, checkpoints.

```python
from torch.distributed.fsdp import fully_shard
import mxtrain.distributed as mxdist

mxdist.enable_mx_all_gather(model)      # before fully_shard and before the optimizer
for block in model.blocks:
    fully_shard(block)
fully_shard(model)
with mxtrain.mx_autocast(recipe=mxtrain.MXFP8Recipe()):
    loss = model(x)                     # weights arrive as MXFP8 bytes, not bf16
loss.backward()
```
See docs/distributed.md.
"""

from mxtrain.distributed.fsdp import (
    MXAllGatherWeight, MXGatheredWeight, all_gather_stats, check_mx_all_gather_shapes, check_shard_shape,
    disable_mx_all_gather, enable_mx_all_gather, enable_quantized_all_gather, mx_weight_names, reset_all_gather_stats,
    set_block_prefetch,
)

__all__ = [
    "MXAllGatherWeight", "MXGatheredWeight", "enable_quantized_all_gather", "enable_mx_all_gather",
    "disable_mx_all_gather",
    "check_mx_all_gather_shapes", "check_shard_shape", "mx_weight_names", "all_gather_stats",
    "reset_all_gather_stats", "set_block_prefetch",
]
