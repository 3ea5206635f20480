"""Every shell and Python snippet of the documentation runs, or says why it cannot run here.

The snippets are the fenced ``bash`` and ``python`` blocks of README.md, docs/ and
k8s/README.md. The HTML comment on the line before a block says how it runs:

- none: on its own, in a folder of its page (its page's snippets in order, so one may make
  what the next uses) holding ``cat.jpg``, ``chart.png``;
- ``<!-- snippet: server -->``: a command that serves until stopped: started on a free port
  (``--port`` added), healthy within its deadline, stopped by Ctrl-C (SIGINT) cleanly;
- ``<!-- snippet: client -->``: run while the getting-started page's server serves, its
  ``127.0.0.1:8000`` pointed at that server's port;
- ``<!-- snippet: skip CATEGORY: why -->``: not run, for one of ``SKIP_CATEGORIES``.

A block without a known comment fails the count test, so a new snippet is run or explained.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.cli_process import cli_env, stop, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
LANGUAGES = {"bash": "bash", "python": "python"}
SKIP_CATEGORIES = {
    "gpu": "a CUDA build of torch and a GPU",
    "hub": "a checkpoint from the Hugging Face hub (this machine is offline)",
    "cluster": "a Kubernetes cluster, a registry or a Ray cluster of your own",
    "benchmark": "a benchmark: minutes to hours; its results page records its run",
    "tested": "run by the test or CI step it names",
}
MARK = re.compile(r"<!-- snippet: (server|client|skip (\w+): (.+)) -->")
SERVER_PAGE = "docs/getting-started.md"
LOCAL = "127.0.0.1:8000"


@dataclass(frozen=True)
class Snippet:
    page: str
    line: int
    language: str
    code: str
    how: str  # "alone", "server", "client", "skip"
    category: str = ""

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    found = [ROOT / "README.md", ROOT / "k8s/README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [p for p in found if p.is_file()]


def snippets() -> list[Snippet]:
    out = []
    for path in pages():
        lines = path.read_text().splitlines()
        page = path.relative_to(ROOT).as_posix()
        i = 0
        while i < len(lines):
            fence = re.match(r"```(\w*)", lines[i])
            if not fence:
                i += 1
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            if fence.group(1) in LANGUAGES:
                mark = MARK.fullmatch(lines[i - 1].strip()) if i else None
                how, category = "unmarked", ""
                if mark is None and i and lines[i - 1].strip() == "":
                    how = "alone"
                elif mark is not None:
                    how = mark.group(1).split()[0]
                    category = mark.group(2) or ""
                code = "\n".join(lines[i + 1 : end]) + "\n"
                out.append(Snippet(page, i + 1, fence.group(1), code, how, category))
            i = end + 1
    return out


SNIPPETS = snippets()


def test_every_snippet_runs_or_says_why_not() -> None:
    """The count: every bash and Python block is run by a test below or skipped for a named
    category; none is unmarked (a comment that is not a snippet mark before a block)."""
    unmarked = [s.id for s in SNIPPETS if s.how == "unmarked"]
    unknown = [s.id for s in SNIPPETS if s.how == "skip" and s.category not in SKIP_CATEGORIES]
    assert not unmarked and not unknown, (unmarked, unknown)
    run = [s for s in SNIPPETS if s.how != "skip"]
    skipped = [s for s in SNIPPETS if s.how == "skip"]
    by = {c: sum(s.category == c for s in skipped) for c in SKIP_CATEGORIES}
    print(f"\n{len(SNIPPETS)} snippets: {len(run)} run, {len(skipped)} skipped {by}")
    assert [s.page for s in SNIPPETS if s.how == "server"].count(SERVER_PAGE) == 1
    # what the runs below cover: at least the getting-started page's and each kind
    assert {s.how for s in run} == {"alone", "server", "client"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder snippets run in: sample images, the demo model's cache beside them."""
    root = tmp_path_factory.mktemp("snippets")
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (240, 320, 3), dtype=np.uint8)).save(root / "cat.jpg")
    Image.fromarray(rng.integers(0, 255, (112, 224, 3), dtype=np.uint8)).save(root / "chart.png")
    return root


def env_for(workdir: Path) -> dict[str, str]:
    env = cli_env(workdir / ".cache")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    return env


def run(snippet: Snippet, cwd: Path, env: dict[str, str], port: int | None = None) -> str:
    code = snippet.code if port is None else snippet.code.replace(LOCAL, f"127.0.0.1:{port}")
    argv = ["bash", "-euo", "pipefail", "-c", code]
    if snippet.language == "python":
        argv = [sys.executable, "-c", code]
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{snippet.id} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def start(snippet: Snippet, cwd: Path, env: dict[str, str]) -> tuple[subprocess.Popen, int]:
    port = free_port()
    command = snippet.code.split("#")[0].strip().rstrip("\\").strip()
    assert "\n" not in command.replace("\\\n", ""), f"{snippet.id}: one command per server"
    log = cwd / f"server-{port}.log"
    proc = subprocess.Popen(
        ["bash", "-c", f"exec {command} --port {port} > {log} 2>&1"],
        cwd=cwd,
        env=env,
        start_new_session=True,
    )
    wait_healthy(proc, f"http://127.0.0.1:{port}", timeout=240, log=log)
    return proc, port


@pytest.mark.parametrize(
    "page", sorted({s.page for s in SNIPPETS if s.how in ("alone", "server")} - {SERVER_PAGE})
)
def test_a_pages_snippets_run(page: str, workdir: Path, tmp_path: Path) -> None:
    """Each page's standalone snippets, in order, in a folder of its own; its servers start
    healthy and stop on Ctrl-C."""
    for name in ("cat.jpg", "chart.png"):
        (tmp_path / name).write_bytes((workdir / name).read_bytes())
    env = env_for(workdir)
    for snippet in [s for s in SNIPPETS if s.page == page]:
        if snippet.how == "alone":
            run(snippet, tmp_path, env)
        elif snippet.how == "server":
            proc, _ = start(snippet, tmp_path, env)
            assert stop(proc, signal.SIGINT, timeout=60) == 0, snippet.id


def test_the_getting_started_server_answers_every_client_snippet(workdir: Path) -> None:
    """The getting-started page's server, then every client snippet of every page against
    it, in page order; the server stops cleanly on Ctrl-C."""
    env = env_for(workdir)
    page = [s for s in SNIPPETS if s.page == SERVER_PAGE]
    server = next(s for s in page if s.how == "server")
    proc, port = start(server, workdir, env)
    try:
        for snippet in [s for s in SNIPPETS if s.how == "client"]:
            out = run(snippet, workdir, env, port)
            assert out.strip(), f"{snippet.id} printed nothing"
        for snippet in [s for s in page if s.how == "alone"]:
            run(snippet, workdir, env)
    finally:
        code = stop(proc, signal.SIGINT, timeout=60)
    assert code == 0
