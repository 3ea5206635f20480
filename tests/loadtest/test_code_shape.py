"""``loadtest/code_shape.py``: the figures of a tiny synthetic checkout (a class of known size, a
two-module import cycle, one long file), alone and side by side."""

from __future__ import annotations

from pathlib import Path

from loadtest.code_shape import main, measure, render, render_pair

# 20 lines, 3 methods (the nested def and class are not its methods), attributes a, b, c, d
# (e is the nested class's own); __init__ 4 lines, run 5 (its nested def included)
BIG = '''\
class Big:
    """A class of known size."""

    def __init__(self):
        self.a = 1
        self.b: int = 2
        self.a += 1

    def grow(self):
        self.c, (self.d, _x) = 3, (4, 5)

        class Inner:
            def set(self):
                self.e = 5

    async def run(self):
        def nested():
            return 1

        return nested()
'''


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def tree(root: Path) -> Path:
    return write(
        root,
        {
            "vitserve/__init__.py": "",
            "cache/__init__.py": "from vitserve.cache.base import Store\n",
            "cache/base.py": "class Store:\n    pass\n",
            # the cycle: urls imports redis_store inside a function, redis_store urls at the top
            "cache/urls.py": "def f():\n    from vitserve.cache.redis_store import S\n",
            "cache/redis_store.py": "from .urls import f\n",
            "encoder/big.py": BIG,
            "client/long.py": "x = 1\n" * 501,
            "tests/test_x.py": "class NotProduct:\n" + "    x = 1\n" * 100,
        },
    )


def test_the_figures_of_a_synthetic_tree(tmp_path: Path) -> None:
    shape = measure(tree(tmp_path))
    assert shape.files == 7  # tests/ is not product code
    assert shape.cycles == [["vitserve.cache.redis_store", "vitserve.cache.urls"]]
    assert shape.long_files == [("client/long.py", 501)]
    big = shape.classes[0]
    assert (big.where, big.lines, big.methods, big.attributes) == ("encoder/big.py:Big", 20, 3, 4)
    assert "encoder/big.py:Big.grow.Inner" not in {c.where for c in shape.classes}
    functions = dict(shape.functions)
    assert functions["encoder/big.py:Big.__init__"] == 4
    assert functions["encoder/big.py:Big.run"] == 5
    assert not any("nested" in name or "Inner" in name for name in functions)
    page = render(shape, "synthetic")
    assert "| import cycles | 1 |" in page
    assert "`vitserve.cache.redis_store` <-> `vitserve.cache.urls`" in page


def test_a_fixed_cycle_and_the_pages(tmp_path: Path) -> None:
    before = tree(tmp_path / "before")
    after = tree(tmp_path / "after")
    write(after, {"cache/redis_store.py": "from .base import Store\n", "cache/redaction.py": ""})
    assert measure(after).cycles == []
    assert measure(after, top=1).classes[0].where == "encoder/big.py:Big"
    page = render_pair(measure(before), measure(after), ("before", "after"))
    assert "| import cycles | 1 | 0 | -1 |" in page
    assert "| product files | 7 | 8 | +1 |" in page
    out = tmp_path / "shape.md"
    assert main(["--before", str(before), "--after", str(after), "--out", str(out)]) == 0
    assert out.read_text().startswith("# Code shape:")
