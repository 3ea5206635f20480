"""The ``vitserve`` console script as a user runs it: make-model, serve + encode, and demo.

``serve`` and ``demo`` start their own local Ray cluster (beside the test session's), offline
(``HF_HUB_OFFLINE``), with a model cache folder that starts empty, on the embedded default: the
node-local store, no Redis configured anywhere (``VITSERVE_*`` and ``REDIS*`` variables are
removed from their environment, but for the CPU-profile overrides, which a run may set).

They run the demo model (a ViT-B tower) in fp32 whatever the host: a CPU-profile pass that
claims native bf16 on a CPU without it would otherwise emulate bf16 at ~1% of fp32's speed. Where
a test needs images to share a forward, it sets the batch cap itself: under the small-cache
profile (8 MiB, no bf16; CI's first ``make test-profiles`` pass) the CPU default cap (682
patches) is below one 448px image, so a batching check that leaned on the host's default fails
there on any host.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import torch

import vitserve
from tests.cli_process import VITSERVE, cli_env
from vitserve.deployments.runner.demo import CHAT_MAX_TOKENS
from vitserve.encoder.device import (
    BF16_ENV,
    LLC_ENV,
    default_max_batch_patches,
)
from vitserve.testing.images import make_image

# Every test but the prefill one runs again as on each CPU profile in CI (cpu_profile): what the
# profile decides (the dtype, the batch cap) reaches the demo test's encoder the same way, and
# the prefill test's minute would come back three times.
PROFILE = pytest.mark.cpu_profile

SMALL_CACHE_PROFILE = {LLC_ENV: "8MiB", BF16_ENV: "0"}
DEMO_MLP_WIDTH = 3072  # the demo model's ViT-B tower
# What every test that needs batching sets (not the host's cache or free memory): room for the
# demo's 448px images (1024 patches) to share a forward.
CAP = "batching.max_batch_patches=4096"
BUDGET = f"budget_bytes={2 * 2**30}"


def _run(
    *args: str, cache: Path, timeout: float = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [VITSERVE, *args],
        capture_output=True,
        text=True,
        env=env or cli_env(cache),
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def user_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The user's cache folder: empty at first, so the demo model is built by the first run."""
    return tmp_path_factory.mktemp("user-cache")


@PROFILE
def test_make_model_writes_a_loadable_sharded_checkpoint(tmp_path) -> None:
    from vitserve.encoder.engine import EncoderEngine

    out = tmp_path / "llava-tiny"
    proc = _run("make-model", "--family", "llava", "--preset", "tiny", str(out), cache=tmp_path)
    assert proc.returncode == 0, proc.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert json.loads((out / "config.json").read_text())["model_type"] == "llava"
    engine = EncoderEngine.from_pretrained(str(out), device="cpu", dtype="fp32")
    assert engine.family == "llava"


@PROFILE
def test_make_model_for_vllm_has_heads_vllms_cpu_attention_takes(tmp_path) -> None:
    """``--vllm``: the same tower, a language model with 32-wide heads (vLLM's CPU attention
    has none narrower), LLaVA's tower under the published tensor names; vitserve loads it."""
    from safetensors import safe_open

    from vitserve.encoder.engine import EncoderEngine

    out = tmp_path / "llava-tiny-vllm"
    proc = _run(
        "make-model", "--family", "llava", "--preset", "tiny", "--vllm", str(out), cache=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads((out / "config.json").read_text())["text_config"]["head_dim"] == 32
    names = set()
    for shard in out.glob("*.safetensors"):
        with safe_open(shard, "np") as f:
            names |= set(f.keys())
    assert any(n.startswith("vision_tower.vision_model.") for n in names), sorted(names)[:5]
    assert EncoderEngine.from_pretrained(str(out), device="cpu", dtype="fp32").family == "llava"


@PROFILE
def test_make_model_rejects_unknown_family(tmp_path) -> None:
    proc = _run("make-model", "--family", "bert", str(tmp_path / "x"), cache=tmp_path)
    assert proc.returncode == 2
    assert "invalid choice: 'bert'" in proc.stderr


def test_serve_demo_with_prefill_then_encode_and_chat_through_http_then_ctrl_c(
    tmp_path, user_cache
) -> None:
    from vitserve.deployments.runner.local import free_port

    port = free_port()
    # Where Ray puts its session (a short path: Ray's socket paths must stay under 108 bytes);
    # the missing-model test checks that nothing lands there.
    ray_tmp = Path(tempfile.mkdtemp(prefix="vr-", dir="/tmp"))
    proc = subprocess.Popen(
        [VITSERVE, "serve", "--model", "demo", "--port", str(port), "--dtype", "fp32", "--prefill"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**cli_env(user_cache), "RAY_TMPDIR": str(ray_tmp)},
    )
    try:
        lines = []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "chat completions at" in line:
                break
        out = "".join(lines)
        assert f"at http://127.0.0.1:{port}" in out, out
        assert (ray_tmp / "ray").is_dir()  # Ray took RAY_TMPDIR
        effective = json.loads(re.search(r"effective config: (\{.*\})", out)[1])
        assert effective["store"] == "node://" and effective["model"] == "demo"
        assert effective["batching"]["max_batch_patches"] is None  # the engine's default
        url = f"http://127.0.0.1:{port}"

        # The replicas took this process's CPU readings (or the pass's overrides of them).
        health = httpx.get(f"{url}/healthz", timeout=30).json()
        assert health["dtype"] == "fp32"
        assert health["max_batch_patches"] == default_max_batch_patches(
            torch.device("cpu"), DEMO_MLP_WIDTH, torch.float32
        )

        files = []
        for i, (w, h) in enumerate([(448, 448), (320, 240), (640, 480)]):
            files.append(tmp_path / f"img{i}.png")
            files[-1].write_bytes(make_image(w, h, seed=500 + i))
        first = _run("encode", *map(str, files), "--url", url, cache=user_cache)
        assert first.returncode == 0, first.stderr
        rows = [line.split("\t") for line in first.stdout.splitlines()]
        assert [r[0] for r in rows] == list(map(str, files))
        assert all(re.fullmatch(r"[0-9a-f]{64}", r[1]) and r[3] == "encoded" for r in rows)
        assert [r[2] for r in rows] == ["256 tokens", "99 tokens", "391 tokens"]
        again = _run("encode", str(files[0]), "--url", url, cache=user_cache)
        assert again.stdout.split("\t")[1] == rows[0][1] and "cached" in again.stdout

        bad = tmp_path / "bad.png"
        bad.write_bytes(b"not an image")
        failed = _run("encode", str(bad), "--url", url, cache=user_cache)
        assert failed.returncode == 1 and "not a recognised image" in failed.stdout

        # The prefill application, at /prefill: the image encoded above, named by its key.
        assert f"chat completions at {url}/prefill/v1/chat/completions" in out
        content = [
            {"type": "image_url", "image_url": {"url": f"vitserve://{rows[0][1]}"}},
            {"type": "text", "text": "What is this?"},
        ]
        chat = httpx.post(
            f"{url}/prefill/v1/chat/completions",
            timeout=300,
            json={
                "messages": [{"role": "user", "content": content}],
                "max_tokens": 3,
                "temperature": 0,
            },
        )
        assert chat.status_code == 200, chat.text
        usage = chat.json()["usage"]
        assert (usage["images_sent"], usage["images_uploaded"], usage["rows_pulled"]) == (1, 0, 256)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        finally:
            shutil.rmtree(ray_tmp, ignore_errors=True)
    assert code == 0


@PROFILE
def test_encode_against_no_server_fails_clearly(tmp_path) -> None:
    from vitserve.deployments.runner.local import free_port

    image = tmp_path / "a.png"
    image.write_bytes(make_image(64, 64))
    proc = _run("encode", str(image), "--url", f"http://127.0.0.1:{free_port()}", cache=tmp_path)
    assert proc.returncode == 2 and "cannot reach" in proc.stderr


@PROFILE
def test_demo_serves_encodes_twice_and_the_second_pass_comes_from_the_store(
    user_cache, monkeypatch
) -> None:
    from vitserve.deployments.common.serving import DEMO_FAMILY, DEMO_PRESET
    from vitserve.testing.models import is_cached

    monkeypatch.setenv("VITSERVE_CACHE", str(user_cache))
    built_before = is_cached(DEMO_FAMILY, DEMO_PRESET)
    proc = _run(
        "demo",
        "--dtype",
        "fp32",
        "--set",
        CAP,
        "--set",
        BUDGET,
        cache=user_cache,
        env=cli_env(user_cache),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "store node://" in out
    assert ("building the demo model" in out) is not built_before
    assert "batch cap: 4096 patches per forward (set by batching.max_batch_patches)" in out
    assert "POST /v1/encode: 7 images (6 distinct) in one request: 448x448 RGB JPEG" in out
    first, second = out.split("\nfirst pass:")[1].split("\nsecond pass:")
    m = re.match(r" 7 images in [0-9.]+ s over HTTP, 6 through the tower in (\d+) forwards", first)
    assert m and int(m[1]) < 6, first
    assert first.count("encoded") == 7
    assert "0 through the tower in 0 forwards" in second
    assert second.count("store (cached)") == 7
    assert re.search(r"GET /v1/embeddings/[0-9a-f]{16}\.\.: 200, \d+ bytes", out)
    # the chat: per turn (turn, sent, uploaded, encoded): only the new image went up
    turns = re.findall(r"^ +(\d) +(\d) +(\d) +(\d) +\d+ +\d+ +\d+ +[0-9.]+s", out, re.M)
    assert turns == [(str(t), str(t), "1", "1") for t in (1, 2, 3)], out
    # the random model's answers: said to be noise, yet not empty (its end token held back)
    assert "the demo model's weights are random: its answers are noise" in out
    answers = re.findall(r"^ +\d +\d +\d +\d +\d+ +\d+ +\d+ +[0-9.]+s  (.*)$", out, re.M)
    assert len(answers) == 3 and "''" not in answers, answers
    ids = re.findall(r"^ +token ids \[([0-9, ]+)\] \(length\)$", out, re.M)
    assert [len(i.split(", ")) for i in ids] == [CHAT_MAX_TOKENS] * 3, out


@PROFILE
def test_the_demo_says_where_its_default_batch_cap_comes_from(monkeypatch) -> None:
    """Without a set cap, the demo reports the CPU default and the readings behind it (here the
    small-cache profile's, whatever the host): on such a CPU a 448px image runs alone."""
    from vitserve.deployments.runner.demo import _batch_cap_line
    from vitserve.deployments.runner.local import local_config

    for name, value in SMALL_CACHE_PROFILE.items():
        monkeypatch.setenv(name, value)
    line = _batch_cap_line({"max_batch_patches": 682}, local_config({}))
    assert line.startswith("batch cap: 682 patches per forward (sized to the CPU's cache: 8 MiB")
    assert f"(from {LLC_ENV}), no native bf16 (from {BF16_ENV})" in line


@PROFILE
def test_demo_with_a_missing_model_fails_clearly_before_starting_anything(tmp_path) -> None:
    ray_tmp = tmp_path / "ray-tmp"
    ray_tmp.mkdir()
    env = {**cli_env(tmp_path), "RAY_TMPDIR": str(ray_tmp)}
    proc = _run("demo", "--model", str(tmp_path / "missing"), cache=tmp_path, env=env)
    assert proc.returncode == 2
    assert "vitserve: error: cannot load model" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert list(ray_tmp.iterdir()) == []  # no Ray session was started


def test_the_stop_report_names_a_failed_drain_and_replicas_that_did_not_report() -> None:
    from vitserve.deployments.runner.cli import stop_report

    out, err = stop_report({"seconds": 6.61, "finished": 1, "cut": 5, "refused": 2, "missing": 0})
    assert out == "stopped in 6.6 s: 1 requests finished, 5 cut and 2 refused with 503"
    assert err == []
    out, err = stop_report({"seconds": 7.0, "error": "GetTimeoutError: late", "missing": 2})
    assert out.startswith("stopped in 7.0 s: 0 requests finished")
    assert err == [
        "vitserve: drain failed (GetTimeoutError: late); stopped anyway",
        "vitserve: 2 HTTP replica(s) did not report their drain",
    ]


# A finder that hides the server extra's modules, as a client-only install (`pip install
# vitserve`) lacks them.
_HIDE = """
import importlib.abc, sys
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"pydantic", "ray", "torch", "fastapi"}:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Hide())
from vitserve.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("args", [["--help"], ["encode", "a.png"], ["serve"]])
def test_without_the_server_extra_the_script_names_it(args: list[str]) -> None:
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _HIDE, *args], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'vitserve[server]'" in proc.stderr and "'pydantic'" in proc.stderr
    assert "Traceback" not in proc.stderr
    version = subprocess.run(
        [sys.executable, "-c", _HIDE, "--version"], capture_output=True, text=True, timeout=60
    )
    assert version.returncode == 0 and version.stdout.strip() == f"vitserve {vitserve.__version__}"


def test_the_script_has_a_version_help_for_each_command_and_vllms_dtype_names(tmp_path) -> None:
    from vitserve.deployments.common.config import VitserveConfig
    from vitserve.errors import ConfigError

    version = _run("--version", cache=tmp_path)
    assert version.returncode == 0 and version.stdout.strip() == f"vitserve {vitserve.__version__}"
    import argparse

    from vitserve.deployments.runner.cli import build_parser

    [commands] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    for name, command in commands.choices.items():  # every option and argument says what it is
        unhelped = [a.dest for a in command._actions if not a.help]
        assert not unhelped, (name, unhelped)
    helped = _run("encode", "--help", cache=tmp_path)
    assert helped.returncode == 0 and "--token" in helped.stdout, helped.stderr
    for spelled, short in (("bfloat16", "bfloat16"), ("float32", "float32"), ("auto", None)):
        assert VitserveConfig.load({"dtype": spelled}).dtype == short
    with pytest.raises((ConfigError, ValueError), match="auto, bfloat16, float16 or float32"):
        VitserveConfig.load({"dtype": "int8"})


def test_config_file_plain_or_serve_config_under_the_flags(tmp_path, monkeypatch) -> None:
    """``--config FILE``: a mapping of config fields, or a Ray Serve config file (the
    RayService's own ``serveConfigV2`` from k8s/base: its encoder application's args); the
    flags and ``--set`` override it; what cannot be read is a ConfigError naming the file."""
    import yaml

    from vitserve.deployments.runner import local
    from vitserve.deployments.runner.cli import _overrides as overrides
    from vitserve.deployments.runner.cli import build_parser, config_file
    from vitserve.errors import ConfigError

    monkeypatch.delenv("VITSERVE_MODEL", raising=False)

    def cfg(*argv: str) -> local.VitserveConfig:
        return local.VitserveConfig.load(overrides(build_parser().parse_args(["serve", *argv])))

    plain = tmp_path / "vitserve.yaml"
    plain.write_text("model: some/model\nlimits:\n  max_images_per_request: 9\nvllm.check_s: 5\n")
    got = cfg("--config", str(plain))
    assert (got.model, got.limits.max_images_per_request, got.vllm.check_s) == ("some/model", 9, 5)
    got = cfg("--config", str(plain), "--model", "demo", "--set", "limits.max_images_per_request=3")
    assert (got.model, got.limits.max_images_per_request) == ("demo", 3)  # the flags win
    assert cfg().model == "demo"  # no file, no flag: the default

    rayservice = Path(__file__).parents[2] / "k8s" / "base" / "rayservice.yaml"
    serve_config = yaml.safe_load(rayservice.read_text())["spec"]["serveConfigV2"]
    serve_file = tmp_path / "serve.yaml"
    serve_file.write_text(serve_config)
    got = cfg("--config", str(serve_file))
    assert got.preprocess_at == "deployment" and got.encoder.autoscaling.max_replicas == 8

    for text, why in (
        ("[1, 2]", "expected a mapping"),
        ("applications: []", "exactly one application"),
        ("model: [unclosed", "not YAML or JSON"),
    ):
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(ConfigError, match=why):
            config_file(str(bad))
    with pytest.raises(ConfigError, match=r"absent\.yaml"):
        config_file(str(tmp_path / "absent.yaml"))
