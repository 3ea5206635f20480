"""``tests/min_versions.py``: pyproject's ``>=`` bounds as the exact pins `make
test-min-versions` installs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.min_versions import lower_bounds, pins

PROJECT = {
    "dependencies": ["httpx>=0.27", "numpy>=1.26", "msgpack"],
    "optional-dependencies": {
        "server": [
            "ray[serve]>=2.60",
            "torch>=2.6",
            "typing_extensions>=4.12.2",
            "numpy>=2.0,<3",
            "av>=14; platform_system != 'Windows'",
        ],
        "dev": ["pytest>=8"],
    },
}


def test_each_lower_bound_becomes_an_exact_pin_and_the_rest_floats() -> None:
    lines, notes = pins(PROJECT, ["server"], ["torch"])
    assert lines == [
        "av==14",
        "httpx==0.27",
        "numpy==2.0",  # bounded twice: the higher bound
        "ray==2.60",  # extras dropped: a constraint takes none
        "typing_extensions==4.12.2",
    ]
    assert notes == ["no lower bound, floats: msgpack", "floats (--float): torch"]


def test_an_extra_not_asked_for_is_not_pinned_and_an_unknown_one_is_an_error() -> None:
    lines, _ = pins(PROJECT, [], [])
    assert lines == ["httpx==0.27", "numpy==1.26"]
    with pytest.raises(ValueError, match="no extra 'serve'"):
        pins({"dependencies": []}, ["serve"], [])


def test_floating_a_package_pyproject_does_not_bound_is_an_error() -> None:
    with pytest.raises(ValueError, match="--float torchvision"):
        pins(PROJECT, ["server"], ["torchvision"])


def test_bounds_compare_as_versions_not_text() -> None:
    bounds, _ = lower_bounds(["pydantic>=2.7", "pydantic>=2.12"])
    assert bounds == {"pydantic": ("pydantic", "2.12")}


def test_the_projects_own_server_bounds_all_pin() -> None:
    import tomllib  # Python 3.11+ (ruff targets 3.10)

    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    project = tomllib.loads(pyproject.read_text())["project"]
    lines, notes = pins(project, ["server"], ["torch"])
    assert any(line.startswith("ray==") for line in lines)
    assert any(line.startswith("transformers==") for line in lines)
    assert notes == ["floats (--float): torch"]  # every other requirement has a lower bound
