"""The documentation's performance and reliability figures, generated from the results pages.

The documentation holds no hand-typed measurement: every figure in its pages ``DOCUMENTS``
(the benchmarks, reliability and development pages of docs/) sits between a pair of markers,

    <!-- generated:NAME -->
    ...
    <!-- /generated:NAME -->

and this script writes what lies between them from the pages under ``loadtest/results/``
(the Markdown the benchmarks and the test suite write), each table followed by a link to the
page it came from, relative to the document it is written in. ``make readme`` rewrites the
sections; ``--check`` changes nothing and exits 1 naming every section that differs
(``tests/loadtest/test_readme_tables.py`` runs it).

Invariants:

* Only the text between a section's markers changes; every other byte of a document is kept.
* Every generated section names the page (or pages) its figures came from, as a link.
* A section's content is a function of the results pages and of the document it lies in
  alone: the same pages give the same documents, whatever the time or machine of the run.
* Each section appears in exactly one document and has a generator here, and each generator
  a section there; a missing, unknown, repeated or unbalanced marker is an error, never a
  silent skip.
* A figure the generator cannot find in its page (a renamed row, a missing table) is an error.

    .venv/bin/python loadtest/readme_tables.py           # rewrite the documents' sections
    .venv/bin/python loadtest/readme_tables.py --check   # exit 1 if they are stale
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = "loadtest/results"
# the documents holding generated sections, from the repository root
DOCUMENTS = ("docs/benchmarks.md", "docs/reliability.md", "docs/development.md")
MARKER = re.compile(r"<!-- (/?)generated:([a-z0-9-]+) -->")


class TableError(ValueError):
    """A results page lacks what a generator reads, or the README's markers are malformed."""


# -- reading the pages ----------------------------------------------------------------------------
def page(root: Path, name: str) -> str:
    path = root / RESULTS / name
    if not path.is_file():
        raise TableError(f"{RESULTS}/{name}: no such results page")
    return path.read_text()


def link(name: str) -> str:
    return f"[`{RESULTS}/{name}`]({RESULTS}/{name})"


def tables(text: str) -> list[list[str]]:
    """Every Markdown table of ``text``, as its lines (header, rule, rows)."""
    out: list[list[str]] = []
    current: list[str] = []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            out.append(current)
            current = []
    return out


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def table_after(text: str, heading: str, source: str) -> list[str]:
    """The first table after the line starting with ``heading``."""
    at = next((i for i, line in enumerate(text.splitlines()) if line.startswith(heading)), None)
    if at is None:
        raise TableError(f"{source}: no line starting with {heading!r}")
    rest = "\n".join(text.splitlines()[at + 1 :])
    found = tables(rest)
    if not found:
        raise TableError(f"{source}: no table after {heading!r}")
    return found[0]


def rows_by(table: list[str], *keys: int) -> dict[tuple[str, ...], list[str]]:
    """A table's rows (past header and rule) by the cells at ``keys``."""
    return {tuple(cells(line)[k] for k in keys): cells(line) for line in table[2:]}


def cpu_flags(text: str) -> str:
    """``; <the page's CPU flags>`` (pages of this kind of machine differ in them: AVX2 only
    or AVX512-BF16, and its speed with them), or nothing for a page without them."""
    flags = re.search(r"flags: ([^;\n]+)", text)
    return f"; {flags.group(1).strip()}" if flags else ""


def machine(text: str, source: str) -> str:
    """The machine a page was measured on, in a few words: its ``Model name`` and ``cpus``
    (the harness's machine lists), or its ``Machine:`` sentence."""
    model = re.search(r"Model name: ([^;\n]+)", text)
    cpus = re.search(r"cpus: (\d+)", text)
    if model and cpus:
        return f"{model.group(1).strip()}, {cpus.group(1)} vCPUs"
    flat = re.sub(r"\s*\n\s*", " ", text)  # a sentence may wrap
    sentence = re.search(r"Machine: (.+?)(?:\. |\.$)", flat)
    if sentence:
        return sentence.group(1).strip()
    raise TableError(f"{source}: no machine named")


def bullets(text: str, heading: str, source: str) -> list[str]:
    """The top-level bullets of the section under ``heading`` (sub-bullets left out)."""
    lines = text.splitlines()
    at = next((i for i, line in enumerate(lines) if line.strip() == heading), None)
    if at is None:
        raise TableError(f"{source}: no section {heading!r}")
    out: list[str] = []
    for line in lines[at + 1 :]:
        if line.startswith("#"):
            break
        if line.startswith(("* ", "- ")):
            out.append("- " + line[2:])
    if not out:
        raise TableError(f"{source}: no bullets under {heading!r}")
    return out


# -- the sections ---------------------------------------------------------------------------------
def hot_path(root: Path) -> str:
    name = "hot-path-cpu.md"
    text = page(root, name)
    table = table_after(text, "dtype ", name)
    overhead = re.search(r"^vitserve HTTP p50 minus in-process forward.*$", text, re.M)
    if overhead is None:
        raise TableError(f"{name}: no 'vitserve HTTP p50 minus in-process forward' line")
    date = re.search(r"^# .*\((\d{4}-\d\d-\d\d)\)", text, re.M)
    when = f", {date.group(1)}" if date else ""
    return "\n".join(
        [
            *table,
            "",
            overhead.group(0),
            "",
            f"From {link(name)} ({machine(text, name)}{when}; the page also has the per-stage "
            "breakdown, where the missed targets' time goes, and `preprocess_at` compared).",
        ]
    )


VLLM_SETUPS = ("vLLM alone", "vLLM + vitserve", "vLLM EPD")


def vllm(root: Path) -> str:
    name = "vllm-cpu.md"
    text = page(root, name)
    models = re.findall(r"^## `(\w+)` model", text, re.M)
    if not models:
        raise TableError(f"{name}: no '## `MODEL` model' sections")
    parts = re.split(r"^## `\w+` model.*$", text, flags=re.M)[1:]
    lines = [
        "| TTFT p50, ms (vs vLLM alone) | vLLM alone | vLLM + vitserve (front) "
        "| vLLM EPD (`ECExampleConnector`) |",
        "|---|---|---|---|",
    ]
    for model, part in zip(models, parts, strict=True):
        ttft = rows_by(table_after(part, "### Time to first token", name), 0, 1)
        scenarios = [s for s, setup in ttft if setup == VLLM_SETUPS[0] and "new image" in s]
        for scenario in scenarios:  # 1 new image, then the many-image request's
            row = []
            for setup in VLLM_SETUPS:
                c = ttft.get((scenario, setup))
                if c is None:
                    raise TableError(f"{name}: {model}: no TTFT row {scenario!r}, {setup!r}")
                row.append(c[3] if setup == VLLM_SETUPS[0] else f"{c[3]} ({c[5]})")
            lines.append(f"| {model}: {scenario} | {' | '.join(row)} |")
        turns = table_after(part, "### Conversation: TTFT per turn", name)
        last = cells(turns[-1])
        alone, front, epd, r_front, r_epd = last[1:6]
        lines.append(
            f"| {model}: conversation turn {last[0]}, two replicas | {alone} "
            f"| {front} ({r_front}) | {epd} ({r_epd}) |"
        )
        forwards = rows_by(table_after(part, "### Encoder forwards", name), 0, 1)
        sent = forwards[("conversation", VLLM_SETUPS[0])][2]
        totals = [forwards[("conversation", s)][5] for s in VLLM_SETUPS]
        lines.append(
            f"| {model}: encoder forwards, conversation ({sent} images) | {' | '.join(totals)} |"
        )
    commit = re.search(r"Commit `(\w+)`, run (\d{4}-\d\d-\d\d)", text)
    run = f"commit `{commit.group(1)}`, {commit.group(2)}; " if commit else ""
    return "\n".join(
        [
            *lines,
            "",
            f"Targets, as the page states them ({run}{machine(text, name)}):",
            "",
            *bullets(text, "## Targets (vLLM + vitserve against vLLM alone in this run)", name),
            "",
            f"From {link(name)}: how each setup was run, TTFT per turn, and where the time goes.",
        ]
    )


def encoder_batching(root: Path) -> str:
    name = "encoder-batching-cpu.md"
    text = page(root, name)
    run = re.search(r"^Run A \(`(.*)`\):$", text, re.M)
    if run is None:
        raise TableError(f"{name}: no 'Run A (...)' line")
    return "\n".join(
        [
            f"`loadtest/bench_encoder.py {run.group(1)}` in one process:",
            "",
            *table_after(text, "Run A", name),
            "",
            f"From {link(name)} ({machine(text, name)}; also bf16, and what it took).",
        ]
    )


def gpu(root: Path) -> str:
    """Every ``gpu-*.md`` page of ``loadtest/bench_gpu.py``: one row per card and family."""
    rows = [
        "| family | card | per-image images/s | bucketed images/s | bucketed / per-image "
        "| forwards | bucketed vs per-image | page |",
        "|---|---|---|---|---|---|---|---|",
    ]
    names = sorted(p.name for p in (root / RESULTS).glob("gpu-*.md"))
    if not names:
        return "No GPU run yet: `make bench-gpu` on a GPU machine writes the first page."
    for name in names:
        text = page(root, name)
        head = re.search(r"^# .*?, (\S+) tower, on (.+) \(\d{4}-\d\d-\d\d\)$", text, re.M)
        ratio = re.search(r"^bucketed / per-image throughput: ([0-9.]+x)", text, re.M)
        ulps = re.search(r"at most ([0-9.e+-]+) ulps of their scale", text)
        if not (head and ratio and ulps):
            raise TableError(f"{name}: no title, throughput ratio or ulps line")
        found = tables(text)
        by = rows_by(found[0], 0) if found else {}
        if {("per-image",), ("bucketed",)} - set(by):
            raise TableError(f"{name}: no per-image or bucketed row")
        per, bucketed = by[("per-image",)], by[("bucketed",)]
        rows.append(
            f"| {head.group(1)} | {head.group(2)} | {per[2]} | {bucketed[2]} | {ratio.group(1)} "
            f"| {per[4]} -> {bucketed[4]} | {ulps.group(1)} ulps | {link(name)} |"
        )
    return "\n".join(rows)


CLIENT_PAGES = (
    ("client-turns-cpu.md", "multi-turn probe"),
    ("client-cached-cpu.md", "all-cached encode"),
    ("client-fetch-cpu.md", "`fetch_chunk` bandwidth"),
    ("client-chat-cpu.md", "TTFT through the prefill route"),
)


def client(root: Path) -> str:
    lines = ["| benchmark | goals, as its page states them | page |", "|---|---|---|"]
    for name, what in CLIENT_PAGES:
        text = page(root, name)
        goals = "; ".join(b[2:] for b in bullets(text, "## Goals", name))
        lines.append(f"| {what} | {goals.replace('|', '/')} | {link(name)} |")
    first = page(root, CLIENT_PAGES[0][0])
    return "\n".join(
        [*lines, "", f"Measured on {machine(first, CLIENT_PAGES[0][0])} (each page says how)."]
    )


def latest(root: Path, scenario: str) -> str:
    """The newest run folder of a load-test scenario (``<scenario>-<timestamp>``)."""
    runs = sorted(p.name for p in (root / RESULTS).glob(f"{scenario}-*") if p.is_dir())
    if not runs:
        raise TableError(f"{RESULTS}: no {scenario}-<timestamp>/ run")
    return runs[-1]


LOAD_SCENARIOS = ("random", "open", "agent", "cache_off", "step", "chat")
LOAD_COLUMNS = ("load", "requests", "seconds", "req/s", "p50 ms", "p99 ms")


def load_test(root: Path) -> str:
    """The ``random`` scenario's latest report in full, then one row per point of every
    scenario's latest run: its load, length, throughput, latency, goodput at both SLOs and
    whether it meets the publishing rule."""
    run = latest(root, "random")
    name = f"{run}/report.md"
    text = page(root, name)
    rows = []
    for scenario in LOAD_SCENARIOS:
        report = f"{latest(root, scenario)}/report.md"
        table = table_after(page(root, report), "Started ", report)
        head = cells(table[0])
        goodput = [h for h in head if h.startswith("goodput")]
        missing = [c for c in (*LOAD_COLUMNS, "publishing rule") if c not in head]
        if missing or len(goodput) != 2:
            raise TableError(f"{report}: no column {missing or 'goodput (two SLOs)'}")
        for line in table[2:]:
            row = dict(zip(head, cells(line), strict=True))
            slos = "; ".join(f"{h.split(', ', 1)[1]}: {row[h]}" for h in goodput)
            rows.append(
                f"| [`{scenario}`]({RESULTS}/{report}) | "
                + " | ".join(row[c] for c in LOAD_COLUMNS)
                + f" | {slos} | {row['publishing rule']} |"
            )
    return "\n".join(
        [
            *table_after(text, "Started ", name),
            "",
            f"![throughput vs concurrency]({RESULTS}/{run}/throughput_vs_concurrency.png)",
            "",
            f"From {link(name)} (the `random` scenario; {machine(text, name)}). Every "
            "scenario's latest run, a row per point (goodput: req/s within the SLO, and their "
            "share):",
            "",
            "| scenario | " + " | ".join(LOAD_COLUMNS) + " | goodput | publishing rule |",
            "|---" * (len(LOAD_COLUMNS) + 3) + "|",
            *rows,
        ]
    )


def autoscaling(root: Path) -> str:
    sim, real = "autoscaling-sim.md", "autoscaling-real.md"
    sim_text, real_text = page(root, sim), page(root, real)
    return "\n".join(
        [
            "Simulated, the work policy and vitserve's router against the request-count "
            "policy and Serve's router (step and sawtooth loads of mixed sizes, five runs "
            "pooled):",
            "",
            *table_after(sim_text, "Requests, each", sim),
            "",
            f"From {link(sim)} (`loadtest/sim_autoscaling.py`; the page states the model of the "
            "replicas and the loads).",
            "",
            "A real 1 -> 2 -> 1 CPU run (`loadtest/autoscale_run.py`):",
            "",
            *table_after(real_text, "`loadtest/autoscale_run.py`", real),
            "",
            f"From {link(real)}.",
            "",
            f"![replicas and queue delay, simulated]({RESULTS}/autoscaling-sim.png)",
            "",
            f"![replicas over time, real run]({RESULTS}/autoscaling-real.png)",
        ]
    )


def floor(root: Path) -> str:
    name = "floor-cpu.md"
    text = page(root, name)
    verdict = next(
        (line for line in text.splitlines() if line.startswith("vitserve's HTTP p50 minus")), None
    )
    rest = next((line for line in text.splitlines() if line.startswith("Where the rest")), None)
    if verdict is None or rest is None:
        raise TableError(f"{name}: no 'vitserve's HTTP p50 minus' or 'Where the rest' line")
    return "\n".join(
        [
            *table_after(text, "Command:", name),
            "",
            verdict,
            "",
            rest,
            "",
            f"From {link(name)} ({machine(text, name)}{cpu_flags(text)}; the page also has "
            "vitserve's stages).",
        ]
    )


def capacity(root: Path) -> str:
    model, shards = "capacity-model.md", "shards-cpu.md"
    model_text, shards_text = page(root, model), page(root, shards)
    gives_out = [line for line in model_text.splitlines() if line.startswith("- **")]
    ratio = next((line for line in shards_text.splitlines() if line.startswith("3 / 1")), None)
    if not gives_out or ratio is None:
        raise TableError(f"{model} or {shards}: no '- **' lines or no '3 / 1' line")
    return "\n".join(
        [
            *table_after(model_text, "## Projection", model),
            "",
            *gives_out,
            "",
            f"From {link(model)} (its inputs and assumptions are listed there), checked "
            f"against the store alone on 1 and 3 Redis Cluster primaries here ({link(shards)}, "
            f"{machine(shards_text, shards)}): {ratio}",
        ]
    )


def routing(root: Path) -> str:
    mixed, repeats = "routing-cpu.md", "repeats-cpu.md"
    mixed_text, repeats_text = page(root, mixed), page(root, repeats)
    verdicts = [
        line for line in mixed_text.splitlines() if line.startswith(("Thumbnail p99", "Throughput"))
    ]
    if len(verdicts) != 2:
        raise TableError(f"{mixed}: no 'Thumbnail p99' and 'Throughput' lines")
    cpu = machine(mixed_text, mixed) + cpu_flags(mixed_text)
    return "\n".join(
        [
            "Serve's router vs vitserve's on two encoder replicas, thumbnails beside large "
            "images, A-B-A blocks in one run (`loadtest/bench_routing.py`):",
            "",
            *table_after(mixed_text, "Blocks in order", mixed),
            "",
            *(f"- {v}" for v in verdicts),
            "",
            f"From {link(mixed)} ({cpu}).",
            "",
            "30% repeated images over two encoder and two ingress replicas "
            "(`loadtest/bench_repeats.py`):",
            "",
            *table_after(repeats_text, "Blocks in order", repeats),
            "",
            f"From {link(repeats)} ({machine(repeats_text, repeats)}; the page says how each "
            "column is counted).",
        ]
    )


def reliability(root: Path) -> str:
    lines = []
    for name, what in (
        ("reliability.md", "every fault and input class `make test` tries"),
        ("reliability-system.md", "the system tier's faults, loads and full-budget fuzzing"),
        ("reliability-large.md", "the 64-image 2K run"),
        ("reliability-multinode.md", "the multi-node cluster's"),
    ):
        text = page(root, name)
        written = r"Written by the test suite .* at commit `([\w+]+)`, (.+?), on (.+?)\.\n"
        head = re.match(written, text)
        if head is None:
            raise TableError(f"{name}: no 'Written by the test suite ... at commit' line")
        table = tables(text)
        rows = len(table[0]) - 2 if table else 0
        lines.append(
            f"- {link(name)}: {what}, {rows} row{'' if rows == 1 else 's'}, written by the test "
            f"suite at commit `{head.group(1)}` ({head.group(2)}, {head.group(3)})."
        )
    return "\n".join(lines)


def test_durations(root: Path) -> str:
    """Each test run's counts and wall time, and the whole of ``.ci/run``'s, from the page
    ``.ci/run`` writes (tests/durations.py)."""
    name = "test-durations.md"
    text = page(root, name)
    runs = table_after(text, "## Runs", name)
    steps = {
        cells(line)[0]: cells(line)[1] for line in table_after(text, "## `.ci/run` steps", name)[2:]
    }
    if "all" not in steps:
        raise TableError(f"{name}: no 'all' row in the steps table")
    others = [
        f"{step} {wall}"
        for step, wall in steps.items()
        if step != "all" and "make test" not in step
    ]
    head = re.search(r"Machine: (.+?)\. Commit `([\w+]+)`, (.+?)\.\n", text)
    if head is None:
        raise TableError(f"{name}: no 'Machine: ... Commit ...' line")
    rest = f" (of which {', '.join(others)})" if others else ""
    return "\n".join(
        [
            *runs,
            "",
            f"The whole `.ci/run`, installs included: **{steps['all']}**{rest}. From {link(name)} "
            f"({head.group(1)}, commit `{head.group(2)}`, {head.group(3)}; the page names the "
            "slowest tests and the costliest folders of each run).",
        ]
    )


def results_index(root: Path) -> str:
    lines = ["| page | what |", "|---|---|"]
    for path in sorted((root / RESULTS).glob("*.md")):
        text = path.read_text()
        first = text.splitlines()[0]
        if first.startswith("# "):
            what = first[2:]
        else:  # a reliability page: the test suite's table, no heading
            found = tables(text)
            rows = [cells(line)[0] for line in found[0][2:]] if found else []
            what = (
                first.split(" (`")[0]
                + ": "
                + (
                    rows[0].split(" (")[0]
                    if len(rows) == 1
                    else f"{len(rows)} fault and input classes"
                )
            )
        lines.append(f"| {link(path.name)} | {what.replace('|', '/')} |")
    return "\n".join(lines)


SECTIONS: dict[str, Callable[[Path], str]] = {
    "hot-path": hot_path,
    "floor": floor,
    "vllm": vllm,
    "encoder-batching": encoder_batching,
    "gpu": gpu,
    "client": client,
    "load-test": load_test,
    "autoscaling": autoscaling,
    "routing": routing,
    "capacity": capacity,
    "reliability": reliability,
    "test-durations": test_durations,
    "results-index": results_index,
}


# -- the README -----------------------------------------------------------------------------------
def spans(readme: str, source: str = "README") -> dict[str, tuple[int, int]]:
    """Each section's content span in the document ``readme`` (between the end of its opening
    marker and the start of its closing one); malformed or unknown markers raise."""
    out: dict[str, tuple[int, int]] = {}
    open_name, open_end = None, 0
    for m in MARKER.finditer(readme):
        closing, name = m.group(1) == "/", m.group(2)
        if not closing:
            if open_name is not None:
                raise TableError(f"{source}: generated:{name} opens inside generated:{open_name}")
            if name in out:
                raise TableError(f"{source}: generated:{name} appears twice")
            open_name, open_end = name, m.end()
        else:
            if name != open_name:
                raise TableError(f"{source}: /generated:{name} closes no open section")
            out[name] = (open_end, m.start())
            open_name = None
    if open_name is not None:
        raise TableError(f"{source}: generated:{open_name} is never closed")
    unknown = sorted(set(out) - set(SECTIONS))
    if unknown:
        raise TableError(f"{source}: unknown sections {unknown}")
    return out


def documents(root: Path) -> dict[str, str]:
    """Each document's text; every section in exactly one of them."""
    texts = {name: (root / name).read_text() for name in DOCUMENTS}
    seen: dict[str, str] = {}
    for name, text in texts.items():
        for section in spans(text, name):
            if section in seen:
                raise TableError(f"generated:{section} is in {seen[section]} and {name}")
            seen[section] = name
    missing = sorted(set(SECTIONS) - set(seen))
    if missing:
        raise TableError(f"missing sections {missing} (in none of {', '.join(DOCUMENTS)})")
    return texts


def relinked(contents: dict[str, str], document: str) -> dict[str, str]:
    """``contents`` (links from the repository root) with their results links made relative
    to ``document``."""
    up = "../" * document.count("/")
    return {n: text.replace(f"]({RESULTS}/", f"]({up}{RESULTS}/") for n, text in contents.items()}


def render(readme: str, contents: dict[str, str]) -> str:
    """``readme`` with each of its sections' content replaced by ``contents[name]``."""
    where = spans(readme)
    out, at = [], 0
    for name, (start, end) in sorted(where.items(), key=lambda item: item[1][0]):
        out += [readme[at:start], "\n", contents[name].strip("\n"), "\n"]
        at = end
    out.append(readme[at:])
    return "".join(out)


def generate(root: Path) -> dict[str, str]:
    return {name: make(root) for name, make in SECTIONS.items()}


def stale(readme: str, contents: dict[str, str]) -> list[str]:
    """The sections of ``readme`` whose text differs from ``contents``."""
    now = render(readme, contents)
    before, after = spans(readme), spans(now)
    return [name for name in before if readme[slice(*before[name])] != now[slice(*after[name])]]


def stale_documents(root: Path) -> dict[str, list[str]]:
    """Each document with sections out of date, and those sections."""
    contents = generate(root)
    out = {}
    for name, text in documents(root).items():
        names = stale(text, relinked(contents, name))
        if names:
            out[name] = names
    return out


def main(argv: list[str] | None = None, root: Path = ROOT) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if stale")
    args = parser.parse_args(argv)
    if args.check:
        found = stale_documents(root)
        for name, names in found.items():
            print(
                f"{name}: generated sections out of date: {', '.join(names)} (run `make readme`)",
                file=sys.stderr,
            )
        if found:
            return 1
        print("the documents' generated sections are up to date")
        return 0
    contents = generate(root)
    for name, text in documents(root).items():
        new = render(text, relinked(contents, name))
        if new != text:
            (root / name).write_text(new)
            print(f"{name}: generated sections rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
