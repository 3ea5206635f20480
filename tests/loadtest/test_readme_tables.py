"""The documentation's generated sections: current with the results pages, derived from them.

The figures of docs/benchmarks.md, docs/reliability.md and docs/development.md are written by
``loadtest/readme_tables.py`` (``make readme``) from the pages under ``loadtest/results/``;
these tests fail when a page changed and a document did not, when a generated section was
edited by hand, and when the generator stops reading its pages.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from loadtest import readme_tables

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / readme_tables.RESULTS


BENCHMARKS = "docs/benchmarks.md"  # the document holding the hot-path and vLLM sections


def copy_of_repo(tmp_path: Path) -> Path:
    """A root holding a copy of the documents and loadtest/results/ (the generator's inputs)."""
    for name in readme_tables.DOCUMENTS:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(RESULTS, tmp_path / readme_tables.RESULTS)
    return tmp_path


def test_the_documents_generated_sections_are_current() -> None:
    stale = readme_tables.stale_documents(ROOT)
    assert stale == {}, f"generated sections {stale} are out of date: run `make readme`"


def test_a_section_in_no_document_or_in_two_is_an_error(tmp_path: Path) -> None:
    root = copy_of_repo(tmp_path)
    bench = root / BENCHMARKS
    text = bench.read_text()
    start = text.index("<!-- generated:vllm -->")
    end = text.index("<!-- /generated:vllm -->") + len("<!-- /generated:vllm -->")
    bench.write_text(text[:start] + text[end:])
    with pytest.raises(readme_tables.TableError, match=re.escape("missing sections ['vllm']")):
        readme_tables.documents(root)
    other = root / "docs/reliability.md"
    bench.write_text(text)
    other.write_text(other.read_text() + "\n" + text[start:end] + "\n")
    with pytest.raises(readme_tables.TableError, match="generated:vllm is in docs/benchmarks"):
        readme_tables.documents(root)


def test_check_fails_on_a_hand_edited_section_and_make_readme_restores_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = copy_of_repo(tmp_path)
    readme = (root / BENCHMARKS).read_text()
    row = "| 1 new image, 448x448 | 62.2 ms |"
    edited = readme.replace(row, "| 1 new image, 448x448 | 50 ms |")
    assert edited != readme, "the hot-path table's first row moved: update this test"
    (root / BENCHMARKS).write_text(edited)

    assert readme_tables.main(["--check"], root=root) == 1
    assert "hot-path" in capsys.readouterr().err
    assert (root / BENCHMARKS).read_text() == edited  # --check changes nothing

    assert readme_tables.main([], root=root) == 0
    assert (root / BENCHMARKS).read_text() == readme
    assert readme_tables.main(["--check"], root=root) == 0


def test_a_changed_results_page_changes_its_section_only(tmp_path: Path) -> None:
    root = copy_of_repo(tmp_path)
    before = readme_tables.generate(root)
    page = root / readme_tables.RESULTS / "vllm-cpu.md"
    text = page.read_text()
    # the small model's one-image row of vLLM + vitserve (the page's last such row): its p50
    # and ratio changed to values no run gave
    rows = [
        r
        for r in text.splitlines()
        if r.startswith("| 1 new image | vLLM + vitserve | ") and r.split(" | ")[5].endswith("x")
    ]
    assert len(rows) == 2, "the page's TTFT rows moved: update this test"
    cells = rows[-1].split(" | ")
    p50, ratio = cells[3], cells[5]
    page.write_text(
        text.replace(
            rows[-1], rows[-1].replace(f" {p50} ", " 98765 ", 1).replace(f" {ratio} ", " 9.99x ", 1)
        )
    )

    after = readme_tables.generate(root)
    assert "98765 (9.99x)" in after["vllm"] and f"{p50} ({ratio})" in before["vllm"]
    assert f"{p50} ({ratio})" not in after["vllm"]
    assert {n for n in before if before[n] != after[n]} == {"vllm"}

    readme = (root / BENCHMARKS).read_text()
    after = readme_tables.relinked(after, BENCHMARKS)
    assert readme_tables.stale(readme, after) == ["vllm"]
    new = readme_tables.render(readme, after)
    outside = readme_tables.MARKER.split(readme)[::6]  # the text outside every section
    assert readme_tables.MARKER.split(new)[::6] == outside


def test_every_generated_section_links_its_results_page() -> None:
    for name, text in readme_tables.generate(ROOT).items():
        links = [part.split(")")[0] for part in text.split("](")[1:]]
        pages = [link for link in links if link.startswith(readme_tables.RESULTS)]
        assert pages, f"section {name} links no results page"
        for link in pages:
            assert (ROOT / link).exists(), f"section {name} links {link}, which does not exist"


def test_the_load_test_table_comes_from_the_newest_run(tmp_path: Path) -> None:
    root = copy_of_repo(tmp_path)
    newest = readme_tables.latest(root, "random")
    newer = root / readme_tables.RESULTS / "random-29991231-000000"
    shutil.copytree(root / readme_tables.RESULTS / newest, newer)
    report = newer / "report.md"
    row = "| 4 users | 2494 | 0 | 61 | 40.94 |"
    assert row in report.read_text(), "the random run's 4-user row changed: update this test"
    report.write_text(report.read_text().replace(row, "| 4 users | 9999 | 0 | 61 | 40.94 |"))
    section = readme_tables.load_test(root)
    assert "| 4 users | 9999 | 0 | 61 | 40.94 |" in section
    assert "| [`random`](loadtest/results/random-29991231-000000/report.md) | 4 users | 9999 |" in (
        section
    )


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("a\n<!-- generated:vllm -->\nb\n", "never closed"),
        ("<!-- /generated:vllm -->\n", "closes no open section"),
        ("<!-- generated:vllm -->\n<!-- generated:client -->\n", "opens inside"),
        ("<!-- generated:nope -->\n<!-- /generated:nope -->\n", "unknown sections ['nope']"),
    ],
)
def test_malformed_markers_are_errors(text: str, error: str) -> None:
    with pytest.raises(readme_tables.TableError, match=re.escape(error)):
        readme_tables.spans(text)


def test_a_page_missing_what_a_section_reads_is_an_error(tmp_path: Path) -> None:
    root = copy_of_repo(tmp_path)
    page = root / readme_tables.RESULTS / "vllm-cpu.md"
    page.write_text(page.read_text().replace("## Targets", "## Aims"))
    with pytest.raises(readme_tables.TableError, match=re.escape("vllm-cpu.md: no section")):
        readme_tables.generate(root)


def test_the_gpu_table_has_a_row_per_page_and_refuses_a_page_it_cannot_read(
    tmp_path: Path,
) -> None:
    root = copy_of_repo(tmp_path)
    results = root / readme_tables.RESULTS
    source = results / "gpu-nvidia-h100-80gb-hbm3.md"
    text = source.read_text()
    assert "| bucketed | 0.298 | 107.4 |" in text, "the H100 page changed: update this test"
    other = text.replace("NVIDIA H100 80GB HBM3", "NVIDIA H200").replace(
        "| bucketed | 0.298 | 107.4 |", "| bucketed | 0.250 | 128.0 |"
    )
    (results / "gpu-nvidia-h200.md").write_text(other)
    section = readme_tables.gpu(root)
    assert "| qwen2_vl | NVIDIA H200 | 45.2 | 128.0 |" in section
    assert "| qwen2_vl | NVIDIA H100 80GB HBM3 | 45.2 | 107.4 |" in section

    (results / "gpu-nvidia-h200.md").write_text(other.replace("throughput:", "speed:"))
    with pytest.raises(readme_tables.TableError, match=re.escape("gpu-nvidia-h200.md: no title")):
        readme_tables.gpu(root)

    for page in results.glob("gpu-*.md"):
        page.unlink()
    assert readme_tables.gpu(root).startswith("No GPU run yet")
