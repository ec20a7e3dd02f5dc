"""Every relative link in README.md, docs/, benchmarks/*.md and the package's *.md names a file of the repository,
and every ``#anchor`` a heading of the page it points to (GitHub's heading ids). No network: web links are not
checked."""

import pathlib
import re
from urllib.parse import unquote

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PAGES = sorted([REPO / "README.md", *REPO.glob("docs/**/*.md"), *REPO.glob("benchmarks/*.md"),
                *REPO.glob("mxtrain/**/*.md")])

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+).+?\1", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """The page without fenced code blocks and code spans (links there are code, not links)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: markup dropped, lower case, punctuation removed, spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: pathlib.Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text(encoding="utf-8"))):
        base = github_anchor(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: pathlib.Path) -> list[str]:
    prose = _prose(page.read_text(encoding="utf-8"))
    return LINK.findall(prose) + REFERENCE.findall(prose)


def broken_links(page: pathlib.Path, root: pathlib.Path = REPO) -> list[str]:
    bad = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto: ... (not checked: no network)
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / unquote(path)).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no file {dest}")
        elif root not in dest.parents and dest != root:
            bad.append(f"{target}: outside the repository")
        elif anchor and dest.suffix == ".md" and unquote(anchor).lower() not in anchors(dest):
            bad.append(f"{target}: no heading with id #{anchor} in {dest.relative_to(root)}")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    assert not broken_links(page), "\n".join(broken_links(page))


def test_the_checker_finds_broken_links(tmp_path):
    # the checker itself: a missing file, a missing anchor, and good links of each kind
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other page\n\n## The `convert` step (CPU)\n")
    page.write_text("# Top\n\n[a](other.md) [b](other.md#the-convert-step-cpu) [c](#top) [d](https://x.org/y)\n"
                    "[e](missing.md) [f](other.md#nowhere) `[g](in-code.md)`\n\n```\n[h](in-fence.md)\n```\n")
    bad = broken_links(page, root=tmp_path)
    assert [b.split(":")[0] for b in bad] == ["missing.md", "other.md#nowhere"]


def test_pages_are_found():
    names = {p.name for p in PAGES}
    assert {"README.md", "numerics.md", "RESULTS.md"} <= names
