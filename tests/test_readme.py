"""The README's "Train your own model" snippet runs as written and prints what its comment says."""

import contextlib
import io
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[1]


def readme_snippet(section: str) -> str:
    """The first ```python block under the README heading ``## <section>``."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", body, re.S).group(1)


def test_train_your_own_model_snippet_runs():
    code = readme_snippet("Train your own model")
    out = io.StringIO()
    scope = {"__name__": "readme_snippet"}
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md:Train your own model", "exec"), scope)  # noqa: S102 - the README's own code
    assert out.getvalue().startswith("[('ln_f', 'LayerNorm', 'mxtrain.modules.normalization.LayerNorm'), ")
    model, torch, nn = scope["model"], scope["torch"], scope["nn"]
    # after handle.undo(): the original torch modules, still tied, trained (finite loss, moved weights)
    assert type(model.blocks[0].c_attn) is nn.Linear and type(model.ln_f) is nn.LayerNorm
    assert model.lm_head.weight is model.wte.weight
    assert torch.isfinite(scope["loss"]) and 4.0 < scope["loss"].item() < 7.0   # about ln(256) = 5.5 at init


def test_convert_keeps_the_state_dict_the_section_promises():
    # "keeping the very same Parameter objects, so tied weights, optimizers and state dicts stay as they were"
    import torch
    import mxtrain
    scope = {}
    classes = readme_snippet("Train your own model").split("model = GPT()")[0]
    exec(compile(classes, "README.md", "exec"), scope)  # noqa: S102 - the README's own code
    model = scope["GPT"]()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    mxtrain.convert(model, mxtrain.MXFP8Recipe(), exclude="lm_head")
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))


def test_mx_autocast_with_torch_autocast_as_the_readme_says():
    # "returns what torch's layer returns there ... exactly the layer run on the bf16 input", either order
    import torch
    import mxtrain
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert "exactly the layer run on the bf16 input" in text  # the statement this test keeps true
    torch.manual_seed(0)
    layer, x = mxtrain.Linear(64, 32, bias=False), torch.randn(8, 64)
    recipe = mxtrain.MXFP8Recipe()
    with mxtrain.mx_autocast(recipe=recipe):
        exact = layer(x.bfloat16())
    with mxtrain.mx_autocast(recipe=recipe), torch.autocast("cpu", dtype=torch.bfloat16):
        inner = layer(x)
        plain = torch.nn.functional.linear(x, layer.weight)
    with torch.autocast("cpu", dtype=torch.bfloat16), mxtrain.mx_autocast(recipe=recipe):
        outer = layer(x)
    assert plain.dtype == exact.dtype == inner.dtype == outer.dtype == torch.bfloat16
    assert torch.equal(inner, exact) and torch.equal(outer, inner)
