"""mxtrain.kernels.static_launch: inductor launches mxtrain's traced Triton kernels statically (CPU: the switch
and the variable the compile workers read; CUDA: a compiled cast with static launch made strict, the same bits)."""

import pytest
import torch

from mxtrain.kernels import _STATIC_LAUNCH_ENV, _STATIC_LAUNCH_SET_BY, static_launch

inductor_config = pytest.importorskip("torch._inductor.config")
def _patch(**values):
    """inductor_config.patch of the switches this torch has (use_static_cuda_launcher is older than the other)."""
    return inductor_config.patch(**{k: v for k, v in values.items() if hasattr(inductor_config, k)})


needs_switch = pytest.mark.skipif(not hasattr(inductor_config, "static_launch_user_defined_triton_kernels"),
                                  reason=f"torch {torch.__version__} has no static launch of user Triton kernels")


@needs_switch
def test_sets_the_switch_and_the_workers_variable(mx_config):
    mx_config(static_launch=True)
    env = {"OTHER": "x"}
    with _patch(static_launch_user_defined_triton_kernels=False, use_static_cuda_launcher=True):
        assert static_launch(env) == "on"
        assert inductor_config.static_launch_user_defined_triton_kernels is True
    assert env == {"OTHER": "x", _STATIC_LAUNCH_ENV: "1", _STATIC_LAUNCH_SET_BY: "1"}
    # a child process of this one finds both: it sets the switch again
    with _patch(static_launch_user_defined_triton_kernels=False, use_static_cuda_launcher=True):
        assert static_launch(env) == "on" and inductor_config.static_launch_user_defined_triton_kernels is True


@needs_switch
@pytest.mark.parametrize("value", ["0", "1"])
def test_a_variable_the_user_set_is_left_alone(value, mx_config):
    mx_config(static_launch=True)
    env = {_STATIC_LAUNCH_ENV: value}
    with inductor_config.patch(static_launch_user_defined_triton_kernels=False):
        assert static_launch(env) == f"left as set ({_STATIC_LAUNCH_ENV}={value})"
        assert inductor_config.static_launch_user_defined_triton_kernels is False
    assert env == {_STATIC_LAUNCH_ENV: value}


def test_off_by_the_mxtrain_switch(mx_config):
    mx_config(static_launch=False)
    env: dict = {}
    with inductor_config.patch(static_launch_user_defined_triton_kernels=False):
        assert static_launch(env) == "off (MXTRAIN_STATIC_LAUNCH=0)"
        assert inductor_config.static_launch_user_defined_triton_kernels is False
    assert env == {}


def test_turning_it_off_where_a_parent_process_turned_it_on_warns(mx_config):
    """A child of a process that imported mxtrain inherits the variable, which torch read as the child started:
    MXTRAIN_STATIC_LAUNCH=0 there comes too late, and says so."""
    mx_config(static_launch=False)
    env = {_STATIC_LAUNCH_ENV: "1", _STATIC_LAUNCH_SET_BY: "1"}
    with pytest.warns(RuntimeWarning, match=r"MXTRAIN_STATIC_LAUNCH=0 cannot take effect in this process: a parent "
                                            r"process that imported mxtrain set TORCHINDUCTOR_STATIC_LAUNCH_USER_"
                                            r"DEFINED_TRITON_KERNELS=1"):
        assert static_launch(env).startswith("on (set by a parent process")
    assert env == {_STATIC_LAUNCH_ENV: "1", _STATIC_LAUNCH_SET_BY: "1"}


@needs_switch
def test_says_when_inductors_static_launcher_is_off(mx_config):
    mx_config(static_launch=True)
    env: dict = {}
    if not hasattr(inductor_config, "use_static_cuda_launcher"):
        pytest.skip("this torch has no use_static_cuda_launcher switch")
    with _patch(static_launch_user_defined_triton_kernels=False, use_static_cuda_launcher=False):
        assert static_launch(env).startswith("on, but inductor's static launcher itself is off")


def test_the_environment_switch_parses():
    from mxtrain import config

    assert config.from_environ({}).static_launch is True
    assert config.from_environ({"MXTRAIN_STATIC_LAUNCH": "0"}).static_launch is False


@needs_switch
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_cast_launches_statically_with_eager_bits():
    """Static launch made strict (a kernel that would bypass it raises) and compiled in this process: the traced
    per-tensor cast (amax and cast kernels, mxtrain's) compiles and gives eager's bytes and scale."""
    from mxtrain.kernels.float8_cast import tensor_cast_float8

    torch.manual_seed(0)
    x = torch.randn(256, 384, device="cuda", dtype=torch.bfloat16) * 3

    def cast(t):
        q, _ = tensor_cast_float8(t, rowwise=True, columnwise=True)
        return q.planes[0].data, q.planes[1].data, q.scale_inv, q.amax

    eager = cast(x)
    torch._dynamo.reset()
    strict = {name: True for name in ("strict_static_cuda_launcher",) if hasattr(inductor_config, name)}
    with inductor_config.patch(static_launch_user_defined_triton_kernels=True, compile_threads=1, **strict):
        compiled = torch.compile(cast, fullgraph=True)(x)
    torch._dynamo.reset()
    for a, b in zip(eager, compiled):
        assert torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a,
                           b.view(torch.uint8) if b.dtype.itemsize == 1 else b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_current_scaled_cast_is_two_launches():
    """A compiled per-tensor current-scaled cast launches mxtrain's two kernels (amax pass, cast) and nothing else:
    its scalar outputs (scale_inv, amax) are 1-element buffers, which inductor allocates without a kernel (an empty
    0-d tensor of a traced graph it fills with one launch each, 256 launches a step of a 16-layer Llama)."""
    import re

    from torch._inductor.utils import run_and_get_code

    from mxtrain.kernels.float8_cast import tensor_cast_float8

    x = torch.randn(256, 384, device="cuda", dtype=torch.bfloat16)

    def cast(t):
        q, _ = tensor_cast_float8(t, rowwise=True, columnwise=True)
        return q.planes[0].data, q.planes[1].data, q.scale_inv, q.amax

    eager = cast(x)
    torch._dynamo.reset()
    compiled, codes = run_and_get_code(torch.compile(cast, fullgraph=True), x)
    torch._dynamo.reset()
    launches = [m for code in codes for m in re.findall(r"^\s*(\w+)\.run\(", code, flags=re.M)]
    assert sorted(k.rsplit("_", 1)[0] for k in launches) == ["_tensor_amax_kernel", "_tensor_cast_kernel"], launches
    assert compiled[2].shape == () and compiled[3].shape == ()
    for a, b in zip(eager, compiled):
        assert torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a,
                           b.view(torch.uint8) if b.dtype.itemsize == 1 else b)
