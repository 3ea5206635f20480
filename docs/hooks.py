"""MkDocs hooks: the site is built from the repository's own Markdown, whose links are the links
a reader follows on GitHub.

Pages outside ``docs/`` join the site under fixed names (``README.md`` is the home page, the
results pages the benchmarks write are ``results/...``, ``k8s/README.md`` is the Kubernetes
guide), so no page is copied and no figure exists twice. Every page's relative links are
written as paths in the repository, from the page's own file; before MkDocs renders a page,
each is resolved there and rewritten: to the page or file it names on the site, or, for a file
the site does not carry (a module, a manifest, a script), to that path as code.

Invariants:

* A relative link whose target exists neither on the site nor in the repository is a warning,
  so ``mkdocs build --strict`` fails on it (MkDocs' own validation fails a link to a missing
  anchor, a missing page, or an absolute path; ``mkdocs.yml``).
* A page's text is changed only inside the parentheses of its links (and a link to a file the
  site lacks loses its brackets): fenced code blocks and inline code are never touched.
* The map from repository paths to site paths is one table, ``EXTERNAL``; the rest of
  ``docs/`` maps to itself.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.plugins.vitserve")

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# repository path (a file, or a folder whose *.md and *.png files all join) -> site path
EXTERNAL = {
    "README.md": "index.md",
    "k8s/README.md": "guides/kubernetes.md",
    "loadtest/results": "results",
}
SITE_SUFFIXES = (".md", ".png")
LINK = re.compile(r"(!?)\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def external_files() -> dict[Path, str]:
    """Each repository file outside docs/ that joins the site, and its site path."""
    out: dict[Path, str] = {}
    for repo, site in EXTERNAL.items():
        path = ROOT / repo
        if path.is_dir():
            for found in sorted(path.rglob("*")):
                if found.is_file() and found.suffix in SITE_SUFFIXES:
                    out[found] = f"{site}/{found.relative_to(path).as_posix()}"
        else:
            out[path] = site
    return out


def on_files(files: Files, config: Any) -> Files:
    for path, site in external_files().items():
        if files.get_file_from_path(site) is not None:
            raise ValueError(f"docs/{site} would hide {path.relative_to(ROOT)}: remove one")
        files.append(File.generated(config, site, abs_src_path=str(path)))
    return files


def site_path(target: Path) -> str | None:
    """The site path of the repository file ``target``, or None when the site lacks it."""
    for path, site in external_files().items():
        if path == target:
            return site
    if target.is_file() and target.is_relative_to(DOCS):
        return target.relative_to(DOCS).as_posix()
    return None


def rewrite(markdown: str, source: Path, site: str) -> tuple[str, list[str]]:
    """``markdown`` (the file ``source``, at ``site`` on the site) with its relative links
    pointed at the site; and the links that name nothing in the repository."""
    broken: list[str] = []
    here = Path(site).parent

    def one(m: re.Match[str]) -> str:
        bang, text, target = m.groups()
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
            return m.group(0)  # a URL, an anchor of this page, an absolute path (MkDocs warns)
        path, sep, anchor = target.partition("#")
        resolved = (source.parent / path).resolve()
        on_site = site_path(resolved)
        if on_site is not None:
            rel = os.path.relpath(on_site, here).replace(os.sep, "/")
            return f"{bang}[{text}]({rel}{sep}{anchor})"
        if resolved.exists() and resolved.is_relative_to(ROOT):
            shown = resolved.relative_to(ROOT).as_posix() + ("/" if resolved.is_dir() else "")
            named = shown in text or f"`{shown.rstrip('/')}`" in text
            return text if named else f"{text} (`{shown}`)"
        broken.append(target)
        return m.group(0)

    out, fenced = [], False
    for line in markdown.splitlines(keepends=True):
        if FENCE.match(line):
            fenced = not fenced
        if fenced or "](" not in line:
            out.append(line)
            continue
        # a link written inside inline code is code, not a link
        code = [m.span() for m in re.finditer(r"`[^`]*`", line)]

        def outside_code(m: re.Match[str], code: list[tuple[int, int]] = code) -> str:
            return m.group(0) if any(a < m.start() < b for a, b in code) else one(m)

        out.append(LINK.sub(outside_code, line))
    return "".join(out), broken


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    source = Path(page.file.abs_src_path)
    text, broken = rewrite(markdown, source, page.file.src_uri)
    for target in broken:
        log.warning(
            "%s: the link %r names nothing in the repository", source.relative_to(ROOT), target
        )
    return text
