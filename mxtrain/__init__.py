"""mxtrain: training and number-format exploration in Microscaling (MX) formats for PyTorch.

```python
import mxtrain
with mxtrain.mx_autocast(recipe=mxtrain.MXFP8Recipe()):
    y = mxtrain.LayerNormMLP(1024, 4096, activation="gelu")(x)
y.sum().backward()
```
"""

from mxtrain import formats, recipes
from mxtrain.autocast import get_recipe, is_autocast_enabled, mx_autocast
from mxtrain.formats import ElemFormat, parse_elemwise_format, parse_format
from mxtrain.modules import (
    Conv1d, Conv2d, GroupedLinear, LayerNorm, LayerNormLinear, LayerNormMLP, Linear, RMSNorm, cross_entropy,
    gated_activation, mx_linear, weight_cast_cache,
)
from mxtrain.modules.activation_checkpoint import checkpoint
from mxtrain.modules._recipe_state import init_recipe_state
from mxtrain.quantization import MXTensor, fake_quantize_mx, quantize_elemwise, quantize_mx
from mxtrain.quantization.float8 import Float8Tensor, fake_quantize_float8, quantize_float8
from mxtrain.recipes import (
    ROLE_NAMES, DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Float8Recipe, MXFP4Recipe, MXFP6Recipe,
    MXFP8Recipe, MXINT8Recipe, MXRecipe, MXRecipeBase, Recipe, RoleSpec, recipe_from_dict, recipe_from_string,
)
from mxtrain.convert import Conversion, convert, unconvert
from mxtrain.graphs import make_graphed_step

__version__ = "0.1.0"

__all__ = [
    "mx_autocast", "get_recipe", "is_autocast_enabled",
    "Recipe", "RoleSpec", "MXRecipeBase", "MXRecipe", "MXFP8Recipe", "MXFP6Recipe", "MXFP4Recipe", "MXINT8Recipe",
    "recipe_from_dict", "recipe_from_string", "ROLE_NAMES",
    "Float8Recipe", "Float8CurrentScaling", "DelayedScaling", "Float8BlockScaling",
    "Float8Tensor", "quantize_float8", "fake_quantize_float8", "convert", "unconvert", "Conversion",
    "make_graphed_step", "weight_cast_cache",
    "Linear", "LayerNormLinear", "LayerNormMLP", "LayerNorm", "RMSNorm", "Conv1d", "Conv2d", "mx_linear",
    "GroupedLinear", "gated_activation", "cross_entropy",
    "checkpoint", "init_recipe_state",
    "MXTensor", "quantize_mx", "fake_quantize_mx", "quantize_elemwise",
    "ElemFormat", "parse_format", "parse_elemwise_format", "formats", "recipes",
    # subpackages imported on demand: mxtrain.distributed (FSDP2), mxtrain.compat.mx (microxcaling API),
    # mxtrain.integrations.llama (Hugging Face Llama conversion), mxtrain.data
]
