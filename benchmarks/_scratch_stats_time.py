import os, torch, triton.testing as tt
from mxtrain.kernels import cuda_cast, dispatch
from mxtrain.kernels.norm_cast import norm_cast
from mxtrain.formats import parse_format
lib = cuda_cast.library()
x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
w = torch.randn(8192, device="cuda", dtype=torch.bfloat16); b = torch.randn(8192, device="cuda", dtype=torch.bfloat16)
g = lambda f: tt.do_bench_cudagraph(f, rep=100, return_mode="median")
fmt = parse_format("fp8_e4m3")
print("graph plain cast", g(lambda: dispatch.quantize(x, "fp8_e4m3", axis=(-1, 0))))
for pre in (1, 3):
    print("graph source kernel pre", pre, g(lambda: cuda_cast._launch(lib, x, fmt, "floor", True, True, True, False, True, False, pre=pre)))
for la in (4, 6, 8, 12):
    cuda_cast.NORM_LOOKAHEAD = la
    print("graph LN / RMS +cast lookahead", la, g(lambda: norm_cast(x, w, b, kind="LayerNorm", axis=(-1, 0))),
          g(lambda: norm_cast(x, w, None, kind="RMSNorm", axis=(-1, 0))))
