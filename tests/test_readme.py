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
