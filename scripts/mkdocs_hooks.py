"""MkDocs hook (mkdocs.yml ``hooks:``): the README's links work on GitHub and in the site.

The site's pages include sections of ``README.md`` (and ``bench/README.md``, the recipe
READMEs) with pymdownx.snippets, so a link in that text is written for GitHub: ``#anchor``
for a heading of the same file, ``bench/README.md`` relative to the repository root. In the
site the text lands on several pages under ``docs/``, so after the snippets are expanded
this hook rewrites, page by page:

- ``#anchor`` that is no heading of this page but of another one -> ``other.md#anchor``
  (the first such page in the nav);
- a path that does not exist relative to the page but does from the repository root:
  ``docs/X`` -> ``X``; a file a page includes whole (or sections of) -> that page.

The docstrings (API pages) are written in reStructuredText habits: Sphinx roles
(``:mod:`x``` / ``:class:`x```) lose the role prefix so ``x`` shows as code, and a paragraph
ending in ``::`` before its literal block ends in ``:``.

Everything else is left alone, so a link whose target is nowhere still fails
``mkdocs build --strict`` (the ``validation`` settings in mkdocs.yml), as it should. The
anchors are computed from the expanded pages with the slugify of mkdocs.yml's ``toc``
(pymdownx.slugs, GitHub's rule), so a README anchor that works on GitHub works here.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

import markdown
from markdown.extensions import Extension
from markdown.preprocessors import Preprocessor

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
_INCLUDE = re.compile(r'^\s*-{1,}8<-{1,}\s+"([^"]+)"\s*$')
_LINK = re.compile(r"\]\(([^()\s]+)\)")
_ROLE = re.compile(r":(?:py:)?(?:mod|class|func|meth|attr|data|obj|exc):(?=`)")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")

_state: dict = {"anchors": {}, "files": {}, "page": None, "order": []}


def _slugify(config):
    toc = config.mdx_configs.get("toc", {})
    slugify = toc.get("slugify")
    if slugify is None:
        from markdown.extensions.toc import slugify
    sep = toc.get("separator", "-")
    return lambda text: slugify(text, sep)


def _heading_text(raw: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", raw)  # [text](url) -> text
    return text.replace("`", "").replace("*", "")


def _anchors(lines: list[str], slug) -> set[str]:
    """The ids toc gives the headings of these lines (duplicates get _1, _2, ...)."""
    seen: set[str] = set()
    fence = False
    for line in lines:
        if _FENCE.match(line):
            fence = not fence
            continue
        m = None if fence else _HEADING.match(line)
        if m:
            base = slug(_heading_text(m.group(2)))
            anchor, n = base, 0
            while anchor in seen:
                n += 1
                anchor = f"{base}_{n}"
            seen.add(anchor)
    return seen


def _expand(text: str, config) -> list[str]:
    md = markdown.Markdown(
        extensions=["pymdownx.snippets"],
        extension_configs={"pymdownx.snippets": config.mdx_configs.get("pymdownx.snippets", {})},
    )
    return md.preprocessors["snippet"].run(text.split("\n"))


def on_files(files, config):
    """Index every page: the anchors of its expanded text and the files it includes."""
    slug = _slugify(config)
    anchors: dict[str, set[str]] = {}
    included: dict[str, str] = {}
    pages = [f for f in files.documentation_pages()]
    nav_order = _nav_order(config)
    pages.sort(key=lambda f: nav_order.get(f.src_uri, len(nav_order)))
    for f in pages:
        text = Path(f.abs_src_path).read_text(encoding="utf-8")
        anchors[f.src_uri] = _anchors(_expand(text, config), slug)
        for line in text.split("\n"):
            m = _INCLUDE.match(line)
            if m:
                path = re.sub(r"(:[0-9,:]*|:[a-z][-_0-9a-z]*)$", "", m.group(1), flags=re.I)
                included.setdefault(posixpath.normpath(path), f.src_uri)
    _state.update(anchors=anchors, files=included, order=[f.src_uri for f in pages])
    return files


def _nav_order(config) -> dict[str, int]:
    order: list[str] = []

    def walk(item):
        if isinstance(item, str):
            order.append(item)
        elif isinstance(item, dict):
            for v in item.values():
                walk(v)
        elif isinstance(item, list):
            for v in item:
                walk(v)

    walk(config.nav or [])
    return {p: i for i, p in enumerate(order)}


def on_page_markdown(markdown_text, page, config, files):
    _state["page"] = page.file.src_uri
    return markdown_text


def _rewrite(target: str, page: str) -> str:
    anchors = _state["anchors"]
    here = posixpath.dirname(page)
    if target.startswith("#"):
        anchor = target[1:]
        if anchor in anchors.get(page, ()):
            return target
        holders = [p for p in _state["order"] if anchor in anchors[p]]
        if holders:  # the first in the nav (the README's pages come before bench-results)
            return posixpath.relpath(holders[0], here or ".") + target
        return target
    if _SCHEME.match(target) or target.startswith("/"):
        return target
    path, _, anchor = target.partition("#")
    if posixpath.normpath(posixpath.join(here, path)) in anchors:
        return target  # a page, relative to this one
    root = posixpath.normpath(path)
    dest = None
    if root.startswith("docs/") and root[len("docs/"):] in anchors:
        dest = root[len("docs/"):]
    elif root in _state["files"]:
        dest = _state["files"][root]
    if dest is None:
        return target
    return posixpath.relpath(dest, here or ".") + (f"#{anchor}" if anchor else "")


class _ReadmeLinks(Preprocessor):
    def run(self, lines):
        page = _state["page"]
        if page is None:
            return lines
        out, fence = [], False
        for line in lines:
            if _FENCE.match(line):
                fence = not fence
            if not fence and "](" in line:
                line = _LINK.sub(lambda m: f"]({_rewrite(m.group(1), page)})", line)
            if not fence and ":`" in line:
                line = _ROLE.sub("", line)
            if not fence and line.endswith("::") and line.strip() != "::":
                line = line[:-1]
            out.append(line)
        return out


class _ReadmeLinksExtension(Extension):
    def extendMarkdown(self, md):  # noqa: N802 (Markdown's API)
        # after pymdownx.snippets (32), before whitespace normalisation (30)
        md.preprocessors.register(_ReadmeLinks(md), "readme_links", 31)


def on_config(config):
    config.markdown_extensions.append(_ReadmeLinksExtension())
    return config
