"""Every family vLLM's CPU build serves: vLLM with vitserve's connector == vLLM alone.

One Serve cluster serves every family's tiny test model (built ``vllm=True``: see
:mod:`vitserve.testing.models` and ``families.py``), one vitserve application per family,
started the way a Serve config of several applications is run (``serve run config.yaml``, the
``applications:`` a RayService's ``serveConfigV2`` lists too); beside it one vLLM per family
over the same folder with the connector, its ``url`` the family's application. All start at
once: a vLLM start is a chain of three processes that each import vLLM (~20 s of one core each
on a 2-vCPU EPYC), so side by side they fill the cores that one alone leaves idle, and one
Ray cluster serves what five ``vitserve serve`` s would.

Per family, two images of different sizes: vLLM alone (no ``uuid`` s: its own tower) and vLLM
with the images' vitserve keys give the same greedy tokens and prompt logprobs, and the
connector loaded every image. (Qwen2-VL runs in ``test_connector.py``, behind the front.)
Every family in fp32 but Qwen3.5, which vLLM's CPU build serves in bf16 only: there vitserve
encodes in bf16 too, and the prompt logprobs agree to bf16's tolerance (:func:`near_tie_gap`).

Qwen3-VL's, Qwen3.5's and Gemma 4's vLLMs (``VIDEO_FAMILIES``) also take a video a prompt:
with the key vitserve gives it sampled as vLLM samples it (``video_for=vllm``), vLLM alone's
answer, its rows loaded by the connector though vLLM's prompt puts a time stamp between each
frame group's (Gemma 4: each frame's); and Gemma 4's through the front to its noise tower.

The families added since the front was tested on Qwen2-VL alone (``NOISE_FAMILIES``) also go
through vitserve's vLLM front, an application of the same cluster, to a second vLLM whose vision
weights are noise: the front's answer is vLLM alone's only if every image came from vitserve,
and that vLLM's own tower (the control, without keys) answers far from it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loadtest.vllm_peer import VllmServer
from tests.cli_process import cli_env, wait_healthy
from tests.redis_process import RedisServer

from .chat import (
    BF16_LOGPROB_TOL,
    LOGPROB_TOL,
    answer,
    body,
    delta,
    keys_of,
    logprob_gap,
    mp4,
    near_tie_gap,
    png,
    post,
    tokens,
    user,
    video_part,
)
from .conftest import (
    ONE_PROCESS_ARGS,
    ONE_PROCESS_ENV,
    SERVED_NAME,
    RayUp,
    Replica,
    after,
    ec_config,
    noise_vision_copy,
    side_by_side,
    vllm_python,
)
from .families import SIZES, VLLM_FAMILIES

FAMILIES = [f for f in VLLM_FAMILIES if f != "qwen2_vl"]
SERVE = str(Path(sys.executable).parent / "serve")
# vLLM's and vitserve's dtype per family: fp32, but vLLM 0.32's CPU gated-DeltaNet kernels take
# bf16 only ("CPU GDN attention requires BF16."), so Qwen3.5 serves in bf16 on both sides
DTYPES = {"qwen3_5": ("bfloat16", "bf16")}
FP32 = ("float32", "fp32")
# each vLLM's KV cache: the tiny models' 4096 positions take a few MiB; vLLM's CPU build keeps
# the cache resident, so 64 MiB instead of the harness's 1 GiB leaves ~0.9 GiB per server of
# the machine's memory to the rest of the suite (the session's stack is up beside these)
KV_CACHE_BYTES = 64 * 2**20
# the families also served through the front to a vLLM whose vision weights are noise
NOISE_FAMILIES = ("qwen3_5", "gemma4")
# the families whose vLLM also takes a video a prompt (vLLM profiles its encoder for one)
VIDEO_FAMILIES = ("qwen3_vl", "qwen3_5", "gemma4")
# each application's share of the cluster's 2 CPUs: all five fit
SHARES = {"encoder.num_cpus": 0.2, "ingress.num_cpus": 0.05, "torch_threads": 1}


def front_prefix(family: str) -> str:
    return f"/{family}-front"


def serve_config(
    models: dict[str, Path], store: str, port: int, fronts: dict[str, str] | None = None
) -> dict:
    """A Serve config: one vitserve application per family at ``/<family>``, over ``store``,
    and for each family of ``fronts`` (family -> a vLLM's URL) vitserve's vLLM front at
    ``/<family>-front`` to that vLLM, encoding through the family's application."""
    front_apps = [
        {
            "name": f"{family}-front",
            "route_prefix": front_prefix(family),
            "import_path": "vitserve.deployments.vllm.app:build_app",
            "args": {
                "model": str(models[family]),
                "store": store,
                "dtype": DTYPES.get(family, FP32)[1],
                "device": "cpu",
                "vllm.urls": [url],
                "vllm.encoder_app": family,
                "vllm.num_cpus": 0.05,
            },
        }
        for family, url in (fronts or {}).items()
    ]
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [
            {
                "name": family,
                "route_prefix": f"/{family}",
                "import_path": "vitserve.deployments.encoder.app:build_app",
                "args": {
                    "model": str(model),
                    "store": store,
                    "dtype": DTYPES.get(family, FP32)[1],
                    "device": "cpu",
                    **SHARES,
                },
            }
            for family, model in models.items()
        ]
        + front_apps,
    }


@contextlib.contextmanager
def serve_run(config: dict, work: Path, urls: list[str], up: RayUp) -> Iterator[subprocess.Popen]:
    """``serve run`` of ``config`` on a new local Ray cluster, until every one of ``urls``
    answers its health route (``up`` set once its Ray node is); stopped as Ctrl-C stops it
    (its own signal, then its group)."""
    path = work / "serve.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    log = work / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [SERVE, "run", "--address", "local", str(path)],
            env=cli_env(work / "cache"),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        port = config["http_options"]["port"]
        up.wait_for(proc, f"http://127.0.0.1:{port}", log)
        for url in urls:
            wait_healthy(proc, url, timeout=600, log=log)
        yield proc
    finally:
        stop_group(proc)
        sys.stderr.write(f"serve run log: {log}\n")


def stop_group(proc: subprocess.Popen, sig: int = signal.SIGINT) -> None:
    """``sig`` to ``proc`` alone (it stops its cluster), then SIGKILL to its process group."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(sig)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(60)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@dataclasses.dataclass
class Family:
    url: str  # its vitserve application
    replica: Replica  # vLLM over its checkpoint, with the connector
    front: str | None = None  # vitserve's vLLM front to ``noise`` (NOISE_FAMILIES)
    noise: Replica | None = None  # vLLM over a copy whose vision weights are noise


def family_vllm(
    family: str, folder: Path, url: str, store: str, log: Path, videos: int = 0, **extra: Any
) -> VllmServer:
    """A vLLM over ``folder`` in the family's dtype whose connector encodes through ``url``,
    taking ``videos`` a prompt (``extra``: more of its connector's config)."""
    from vitserve.deployments.runner.local import free_port

    return VllmServer(
        vllm_python(),
        str(folder),
        free_port(),
        dtype=DTYPES.get(family, FP32)[0],
        log_path=str(log),
        served_model_name=SERVED_NAME,
        # all at once, beside the cluster's start (four took ~320 s with it on the 8 MiB EPYC;
        # six start now)
        ready_timeout=900,
        kv_cache_bytes=KV_CACHE_BYTES,
        max_videos=videos,
        extra_env={"VLLM_CPU_OMP_THREADS_BIND": "0-1", **ONE_PROCESS_ENV},
        # the connector reaches vitserve only when a request names a key
        extra_args=["--ec-transfer-config", ec_config(url, store, **extra), *ONE_PROCESS_ARGS],
    )


@pytest.fixture(scope="module")
def families(
    store: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Family]]:
    """family -> its application, vLLM, and (NOISE_FAMILIES) front and noise vLLM, all
    started at once."""
    from vitserve.deployments.runner.local import free_port
    from vitserve.testing.models import cached_model

    work = tmp_path_factory.mktemp("families")
    models = {family: cached_model(family, "tiny", vllm=True) for family in FAMILIES}
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    urls = {family: f"{base}/{family}" for family in FAMILIES}
    servers = {
        family: family_vllm(
            family,
            models[family],
            urls[family],
            store.url,
            work / f"vllm-{family}.log",
            videos=int(family in VIDEO_FAMILIES),
        )
        for family in FAMILIES
    }
    # its tower is deliberately not vitserve's: its connector compares all but the weights
    noise = {
        family: family_vllm(
            family,
            noise_vision_copy(models[family], work / f"{family}-noise"),
            urls[family],
            store.url,
            work / f"vllm-{family}-noise.log",
            videos=int(family in VIDEO_FAMILIES),
            check_model="tower-may-differ",
        )
        for family in NOISE_FAMILIES
    }
    fronts = {family: f"{base}{front_prefix(family)}" for family in NOISE_FAMILIES}
    config = serve_config(models, store.url, port, {f: s.url for f, s in noise.items()})
    up = RayUp()
    service = serve_run(config, work, [*urls.values(), *fronts.values()], up)
    vllms = [after(up, server) for server in [*servers.values(), *noise.values()]]
    with side_by_side(service, *vllms):  # one that cannot start fails the module
        yield {
            family: Family(
                urls[family],
                Replica(family, servers[family]),
                fronts.get(family),
                Replica(f"{family}-noise", noise[family]) if family in noise else None,
            )
            for family in FAMILIES
        }


@pytest.mark.parametrize("family", FAMILIES)
def test_connector_equals_vllm_alone(family: str, families: dict[str, Family]) -> None:
    url, replica = families[family].url, families[family].replica
    rng = np.random.default_rng(11)
    images = [png(rng, w, h) for w, h in SIZES[family]]
    alone = answer(post(replica.url, body([user(images)])))
    keys = keys_of(url, images)
    before = replica.counts()
    hit = answer(post(replica.url, body([user(images, uuids=keys)])))
    moved = delta(before, replica.counts())
    assert tokens(hit) == tokens(alone)
    gap, tol = gap_and_tolerance(family, hit, alone)
    print(f"{family}: max |prompt logprob difference| from vLLM alone {gap:.2g}")
    assert gap < tol, gap
    assert moved["loads"] == len(set(keys)) and moved["load_fallbacks"] == 0, moved


def gap_and_tolerance(family: str, doc: dict[str, Any], ref: dict[str, Any]) -> tuple[float, float]:
    """The prompt logprobs' gap between ``doc`` and ``ref``, and the family's tolerance."""
    if family in DTYPES:
        return near_tie_gap(doc, ref), BF16_LOGPROB_TOL
    return logprob_gap(doc, ref), LOGPROB_TOL


@pytest.mark.parametrize("family", NOISE_FAMILIES)
def test_the_front_to_a_noise_tower_gives_vllm_alones_answer(
    family: str, families: dict[str, Family]
) -> None:
    """Through vitserve's front, a vLLM whose vision weights are noise gives vLLM alone's
    tokens and prompt logprobs, every image loaded by its connector; the control, the same
    request to it without the front (its own tower), answers far from them."""
    f = families[family]
    assert f.front and f.noise
    rng = np.random.default_rng(12)
    images = [png(rng, w, h) for w, h in SIZES[family]]
    alone = answer(post(f.replica.url, body([user(images)])))
    before = f.noise.counts()
    served = answer(post(f.front, body([user(images)])))
    moved = delta(before, f.noise.counts())
    control = answer(post(f.noise.url, body([user(images)])))
    gap, tol = gap_and_tolerance(family, served, alone)
    control_gap, _ = gap_and_tolerance(family, control, alone)
    print(f"{family}: through the front {gap:.2g} from vLLM alone, its own tower {control_gap:.2g}")
    assert tokens(served) == tokens(alone)
    assert gap < tol, gap
    assert moved["loads"] == len(images) and moved["load_fallbacks"] == 0, moved
    assert control_gap > 10 * tol, control_gap


def gemma4_clip(seed: int) -> bytes:
    """40 frames of 480x288 at 10 fps: sides Gemma 4's processor keeps (``SIZES``), more frames
    than vLLM's 32."""
    return mp4(np.random.default_rng(seed), 40, 480, 288, block=8)


def video_messages(clip: bytes, uuid: str | None = None) -> list[dict[str, Any]]:
    parts = [video_part(clip, uuid), {"type": "text", "text": "What happens?"}]
    return [{"role": "user", "content": parts}]


@pytest.mark.parametrize("family", VIDEO_FAMILIES)
def test_a_video_with_its_key_equals_vllm_alone(family: str, families: dict[str, Family]) -> None:
    """A ``video_url`` part (40 frames of 128x96 at 10 fps), keyed as the front keys it
    (``video_for=vllm``). Qwen: vLLM's ``qwen3_vl`` loader samples 8 at 2 fps at
    round(linspace) and its processor sizes the clip as vitserve does (frames within the
    bounds: not resized), its prompt a time stamp before each of the 4 frame groups (rows
    that are not one run: the connector's placeholder holds text between them). Gemma 4
    (frames of 480x288: no resize, as its images in ``SIZES``): vLLM's OpenCV loader takes 32
    at linspace (not the frames transformers' processor would: the model's own sampling keys
    the clip otherwise), each an image within 70 soft tokens after its ``mm:ss``. vLLM with
    the video's vitserve key gives vLLM alone's tokens and prompt logprobs, the video loaded
    by its connector."""
    from vitserve.client import EncoderClient

    url, replica = families[family].url, families[family].replica
    clip = gemma4_clip(13) if family == "gemma4" else mp4(np.random.default_rng(13), 40, 128, 96)
    (key,) = keys_of(url, [clip])
    if family == "gemma4":
        with EncoderClient(url) as client:  # the model's own sampling: other frames
            assert client.encode([clip])[0].key != key
    alone = answer(post(replica.url, body(video_messages(clip))))
    before = replica.counts()
    hit = answer(post(replica.url, body(video_messages(clip, key))))
    moved = delta(before, replica.counts())
    gap, tol = gap_and_tolerance(family, hit, alone)
    print(f"{family} video: max |prompt logprob difference| from vLLM alone {gap:.2g}")
    assert tokens(hit) == tokens(alone)
    assert gap < tol, gap
    assert moved["loads"] == 1 and moved["load_fallbacks"] == 0, moved


def test_a_gemma4_video_through_the_front_to_a_noise_tower_gives_vllm_alones_answer(
    families: dict[str, Family],
) -> None:
    """A Gemma 4 ``video_url`` part (40 frames) through vitserve's front, which keys it as
    vLLM samples it, to a vLLM whose vision weights are noise: vLLM alone's tokens and prompt
    logprobs, the video loaded by the connector; the noise vLLM's own tower answers far."""
    f = families["gemma4"]
    assert f.front and f.noise
    clip = gemma4_clip(14)
    alone = answer(post(f.replica.url, body(video_messages(clip))))
    before = f.noise.counts()
    served = answer(post(f.front, body(video_messages(clip))))
    moved = delta(before, f.noise.counts())
    control = answer(post(f.noise.url, body(video_messages(clip))))
    gap, tol = gap_and_tolerance("gemma4", served, alone)
    control_gap, _ = gap_and_tolerance("gemma4", control, alone)
    print(f"gemma4 video: through the front {gap:.2g} from vLLM alone, its own {control_gap:.2g}")
    assert tokens(served) == tokens(alone)
    assert gap < tol, gap
    assert moved["loads"] == 1 and moved["load_fallbacks"] == 0, moved
    assert control_gap > 10 * tol, control_gap
