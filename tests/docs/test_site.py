"""The documentation site builds with ``mkdocs build --strict``, and a broken link fails it.

``make docs`` (a step of .ci/run) builds the real site; these tests build a copy of the
repository's files with one page broken on purpose (a missing page, a missing anchor, a
missing repository file), and check docs/hooks.py's link rewriting on its own.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MKDOCS = str(Path(sys.executable).parent / "mkdocs")


def load_hooks():
    spec = importlib.util.spec_from_file_location("vitserve_docs_hooks", ROOT / "docs/hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def repo_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The repository's files (tracked, and new ones not ignored), copied."""
    root = tmp_path_factory.mktemp("repo")
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in listed)):
        source = ROOT / name
        if source.is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, root / name)
    return root


def build(root: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [MKDOCS, "build", "--strict", "--site-dir", str(site)],
        cwd=root,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
    )


def test_the_site_builds_strict_with_every_page_and_the_results(
    repo_copy: Path, tmp_path: Path
) -> None:
    done = build(repo_copy, tmp_path / "site")
    assert done.returncode == 0, done.stderr[-3000:]
    site = tmp_path / "site"
    for page in ("index.html", "guides/kubernetes/index.html", "results/vllm-cpu/index.html"):
        assert (site / page).is_file(), page
    # the README's links became the site's: the home page links the getting-started page
    assert 'href="getting-started/"' in (site / "index.html").read_text()


@pytest.mark.parametrize(
    ("link", "says"),
    [
        ("[a page](no-such-page.md)", "names nothing in the repository"),
        ("[an anchor](concepts/routing.md#no-such-heading)", "does not contain an anchor"),
        ("[a file](../deployments/no_such_module.py)", "names nothing in the repository"),
    ],
)
def test_a_broken_link_fails_the_build(
    repo_copy: Path, tmp_path: Path, link: str, says: str
) -> None:
    page = repo_copy / "docs/getting-started.md"
    text = page.read_text()
    try:
        page.write_text(text + f"\nSee {link}.\n")
        done = build(repo_copy, tmp_path / "site")
    finally:
        page.write_text(text)
    said = done.stdout + done.stderr
    assert done.returncode != 0
    assert says in said and "Aborted" in said, said[-3000:]


def test_links_are_rewritten_to_the_site_or_shown_as_paths() -> None:
    hooks = load_hooks()
    source = ROOT / "docs/guides/running.md"
    text, broken = hooks.rewrite(
        "[idle](../../loadtest/results/idle-cpu.md) [k8s](../../k8s/README.md#upgrade) "
        "[`quiet`](../../deployments/runner/quiet.py) [sdk](sdk.md)\n"
        "```bash\n[not a link](nowhere.md)\n```\n`[code](nowhere.md)` [gone](gone.md)\n",
        source,
        "guides/running.md",
    )
    assert "[idle](../results/idle-cpu.md)" in text
    assert "[k8s](kubernetes.md#upgrade)" in text
    assert "`quiet` (`deployments/runner/quiet.py`)" in text
    assert "[sdk](sdk.md)" in text
    assert "[not a link](nowhere.md)" in text and "`[code](nowhere.md)`" in text
    assert broken == ["gone.md"]


def table_problems(text: str) -> list[str]:
    """Tables of ``text`` whose delimiter row has another number of cells than their header
    (Markdown then renders no table at all)."""

    def cells(line: str) -> int:
        line = re.sub(r"`[^`]*`", "code", line.strip()).replace("\\|", "")
        return len(line.strip("|").split("|"))

    lines = text.splitlines()
    return [
        f"line {i + 1}: {cells(lines[i - 1])} header cells, {cells(lines[i])} delimiters"
        for i in range(1, len(lines))
        if DELIMITER.fullmatch(lines[i].strip())
        and lines[i - 1].lstrip().startswith("|")
        and cells(lines[i]) != cells(lines[i - 1])
    ]


DELIMITER = re.compile(r"\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?")


def test_every_table_of_the_site_renders() -> None:
    hooks = load_hooks()
    pages = [*hooks.external_files(), *(ROOT / "docs").rglob("*.md")]
    bad = {
        str(p.relative_to(ROOT)): problems
        for p in pages
        if p.suffix == ".md" and (problems := table_problems(p.read_text()))
    }
    assert bad == {}
    assert table_problems("| a | b |\n|---|---|---|\n| 1 | 2 |\n") == [
        "line 2: 2 header cells, 3 delimiters"
    ]


def test_the_readme_is_a_front_page() -> None:
    """What, for whom, the two commands, the vLLM example and links: under 200 lines, the
    manual on the site."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 200
    assert readme.index("make demo") < readme.index("## vLLM with vitserve")
    assert "docs/getting-started.md" in readme and "docs/reference/config.md" in readme
