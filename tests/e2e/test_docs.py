"""The documentation site (issue 30 item 4): ``mkdocs build --strict`` succeeds, every page
and the API reference are there, a broken link or anchor fails the build, and the README's
sections (the pages' one source) are all included and its anchors are GitHub's."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, base_env

PAGES = (
    "index", "getting-started", "strategies", "compression", "configuration", "recipes",
    "recipes-imagenet", "recipes-nlp3d", "sweeps", "launching", "faults", "signals",
    "benchmarks", "bench-results", "summary-json", "architecture", "development", "api",
)
API_MODULES = (
    "easgd_lightning.strategies", "easgd_lightning.strategies.diloco",
    "easgd_lightning.strategies.local_sgd", "easgd_lightning.strategies.sync_easgd",
    "easgd_lightning.strategies.elastic", "easgd_lightning.hooks",
    "easgd_lightning.hooks.compressors.base", "easgd_lightning.hooks.elastic",
    "easgd_lightning.comm.meter",
)
_MARKER = re.compile(r"^<!-- --8<-- \[(start|end):([a-z][-_0-9a-z]*)\] -->$")
_FENCE = re.compile(r"^\s*(```|~~~)")


def _mkdocs(config: Path, site: Path) -> subprocess.CompletedProcess:
    pytest.importorskip("mkdocs", reason="the docs extra (make venv installs it)")
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        cwd=REPO, env=base_env(NO_MKDOCS_2_WARNING="1"), capture_output=True, text=True, timeout=300,
    )


def _first_docstring_line(path: Path, cls: str) -> str:
    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return ast.get_docstring(node).splitlines()[0]


@pytest.mark.slow
def test_strict_build_has_every_page_and_the_api(tmp_path: Path) -> None:
    site = tmp_path / "site"
    proc = _mkdocs(REPO / "mkdocs.yml", site)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    for page in PAGES:
        html = site / f"{page}.html"
        assert html.is_file(), f"{page}.html missing from the built site"
        text = html.read_text()
        assert "8&lt;--" not in text and "--8<--" not in text, f"{page}: an include was not expanded"
    api = (site / "api.html").read_text()
    first = _first_docstring_line(REPO / "easgd_lightning/strategies/diloco.py", "DiLoCoStrategy")
    assert first in api, first
    for module in API_MODULES:
        assert f'id="{module}"' in api, module
    # the README's text arrives through its markers: a sentence of its Strategies section
    assert "dedicated server rank" in (site / "strategies.html").read_text()


def _broken_copy(tmp_path: Path, page: str, line: str) -> Path:
    """The site's config with its docs/ copied to tmp_path and ``line`` added to ``page``."""
    docs = tmp_path / "docs"
    shutil.copytree(REPO / "docs", docs)
    with open(docs / page, "a") as f:
        f.write(f"\n{line}\n")
    text = (REPO / "mkdocs.yml").read_text()
    for old, new in (
        ("docs_dir: docs", f"docs_dir: {docs}"),
        ("- scripts/mkdocs_hooks.py", f"- {REPO / 'scripts/mkdocs_hooks.py'}"),
        ('base_path: ["."]', f'base_path: ["{REPO}"]'),
        ('paths: ["."]', f'paths: ["{REPO}"]'),
    ):
        assert old in text, old
        text = text.replace(old, new)
    config = tmp_path / "mkdocs.yml"
    config.write_text(text)
    return config


@pytest.mark.slow
@pytest.mark.parametrize(
    "page,line,expected",
    [
        ("strategies.md", "See [the nowhere page](nowhere.md).", "nowhere.md"),
        ("getting-started.md", "See [a section](#no-such-section).", "no-such-section"),
        ("faults.md", "See [a section](signals.md#no-such-section).", "no-such-section"),
        ("compression.md", "See [a file](bench/NO_README.md).", "NO_README.md"),
    ],
    ids=["page", "anchor", "anchor-on-another-page", "repo-file"],
)
def test_a_broken_link_fails_the_strict_build(tmp_path: Path, page: str, line: str, expected: str) -> None:
    proc = _mkdocs(_broken_copy(tmp_path, page, line), tmp_path / "site")
    assert proc.returncode != 0, "a broken link passed mkdocs build --strict"
    assert expected in proc.stderr, proc.stderr[-3000:]


def _sections(text: str) -> list[tuple[str, str | None]]:
    """README's top-level sections: (heading, the marker name right after it)."""
    lines, out, fence = text.split("\n"), [], False
    for i, line in enumerate(lines):
        if _FENCE.match(line):
            fence = not fence
        if not fence and line.startswith("## "):
            m = _MARKER.match(lines[i + 1]) if i + 1 < len(lines) else None
            out.append((line[3:], m.group(2) if m and m.group(1) == "start" else None))
    return out


def test_every_readme_section_is_on_a_page_and_its_links_work_on_github() -> None:
    slugs = pytest.importorskip("pymdownx.slugs", reason="the docs extra (make venv installs it)")
    readme = (REPO / "README.md").read_text()
    included = set()
    for page in (REPO / "docs").glob("*.md"):
        included |= set(re.findall(r'^--8<-- "README\.md:([a-z][-_0-9a-z]*)"$', page.read_text(), re.M))
    missing = [h for h, name in _sections(readme) if h != "Documentation" and name not in included]
    assert not missing, (
        f"README sections on no page of the site: {missing}; put <!-- --8<-- [start:NAME] --> after "
        "the heading and <!-- --8<-- [end:NAME] --> before the next one, and include NAME in docs/"
    )
    starts = re.findall(r"^<!-- --8<-- \[start:([^\]]+)\] -->$", readme, re.M)
    ends = re.findall(r"^<!-- --8<-- \[end:([^\]]+)\] -->$", readme, re.M)
    assert len(starts) == len(set(starts)) and set(ends) <= set(starts), (starts, ends)
    # GitHub's anchors (pymdownx.slugs, the site's slugify too): every #link of the README
    slug = slugs.slugify(case="lower")
    heads, fence = set(), False
    for line in readme.split("\n"):
        if _FENCE.match(line):
            fence = not fence
        m = None if fence else re.match(r"^#{1,6} (.+)$", line)
        if m:
            heads.add(slug(re.sub(r"[`*]", "", m.group(1)), "-"))
    links = set(re.findall(r"\]\(#([^)]+)\)", readme))
    assert links and links <= heads, sorted(links - heads)
    # and its links to files (docs/strategies.md, ...) point at files that exist
    paths = {p.split("#")[0] for p in re.findall(r"\]\(([^)#\s][^)\s]*)\)", readme)
             if not re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", p)}  # not https:, mailto:
    assert "docs/strategies.md" in paths
    assert not [p for p in paths if not (REPO / p).exists()], sorted(p for p in paths if not (REPO / p).exists())
