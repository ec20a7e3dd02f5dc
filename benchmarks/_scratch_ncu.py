import torch
from mxtrain.kernels import cuda_cast
from mxtrain.kernels.norm_cast import norm_cast
from mxtrain.kernels.activation_cast import activation_cast
from mxtrain.formats import parse_format
x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
w = torch.randn(8192, device="cuda", dtype=torch.bfloat16); b = torch.randn(8192, device="cuda", dtype=torch.bfloat16)
for _ in range(2):
    norm_cast(x, w, b, kind="LayerNorm", axis=(-1, 0)); norm_cast(x, w, None, kind="RMSNorm", axis=(-1, 0))
    activation_cast(x, "relu", "fp8_e4m3", axis=(-1, 0)); activation_cast(x, "gelu", "fp8_e4m3", axis=(-1, 0))
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
norm_cast(x, w, b, kind="LayerNorm", axis=(-1, 0)); norm_cast(x, w, None, kind="RMSNorm", axis=(-1, 0))
activation_cast(x, "relu", "fp8_e4m3", axis=(-1, 0)); activation_cast(x, "gelu", "fp8_e4m3", axis=(-1, 0))
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
