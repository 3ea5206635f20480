"""Application builders: the vitserve Serve application from one strict config.

``build_app`` is what ``serve run vitserve.deployments.app:build_app model=demo`` and a
``serve build``-style YAML (``import_path: vitserve.deployments.app:build_app`` with ``args``)
call. ``args`` are the config's fields; nested fields take dotted names
(``limits.max_images_per_request=16``) or nested mappings. ``build_application(config)`` is the
same from a ``VitserveConfig`` (the CLI, tests, benchmarks). The model ``demo`` is the small
random-weight model, built once into the cache folder; it is never used in place of a model
that failed to load.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vitserve.deployments.config import DeploymentConfig, VitserveConfig

DEMO_MODEL = "demo"

# The replicas' processes use one malloc arena. Serve runs work on pool threads, and glibc gives
# those threads their own arenas, whose heaps it unmaps whenever they empty (whatever the trim
# threshold), so every image's multi-MB arrays were faulted in afresh: ~3.8k minor faults and
# 20-70 ms to preprocess a 448px image in the replica vs 5 ms in a tuned process; with one arena
# (and ``tune_cpu_allocator``), ~0 faults and 5 ms, and the encoder's forwards gained too.
WORKER_ENV = {"MALLOC_ARENA_MAX": "1"}
DEMO_FAMILY, DEMO_PRESET = "qwen2_vl", "small"


def resolve_model(model: str) -> str:
    """``demo`` -> the folder of the demo model (built once); anything else unchanged."""
    if model != DEMO_MODEL:
        return model
    from vitserve.encoder.testmodels import cached_model

    return str(cached_model(DEMO_FAMILY, DEMO_PRESET))


def check_model(cfg: VitserveConfig) -> None:
    """Fail now, with the loader's clear error, if the model's config and image processor
    cannot be read or its family is unsupported, instead of after replicas retry to start.
    Reads no weights."""
    from vitserve.encoder.loading import load_preprocessor

    load_preprocessor(cfg.model, revision=cfg.revision)


def deployment_options(d: DeploymentConfig) -> dict[str, Any]:
    """Serve deployment options from vitserve's checked subset."""
    options: dict[str, Any] = {
        "ray_actor_options": {
            "num_cpus": d.num_cpus,
            "num_gpus": d.num_gpus,
            "runtime_env": {"env_vars": WORKER_ENV},
        },
        "max_ongoing_requests": d.max_ongoing_requests,
        "max_queued_requests": d.max_queued_requests,
    }
    if d.autoscaling is not None:
        # policy "requests": Serve's own (ongoing requests per replica); "work": the encoder's
        # patch-based policy (vitserve.deployments.autoscaling), parameters in policy_kwargs.
        from vitserve.deployments.autoscaling import serve_autoscaling_config

        options["autoscaling_config"] = serve_autoscaling_config(d.autoscaling)
    else:
        options["num_replicas"] = d.num_replicas
    return options


def build_app(args: Mapping[str, Any]):
    """The application from ``serve run``/YAML-style args (one parameter, as Serve requires):
    config fields, nested ones by dotted names or nested mappings; values may be strings."""
    return build_application(VitserveConfig.load(args))


def build_application(cfg: VitserveConfig):
    """The bound vitserve application for ``cfg``: ingress -> encoder, with the preprocess
    deployment between them when ``preprocess_at`` is ``deployment``."""
    from vitserve.deployments.encoder import EncoderDeployment, PreprocessDeployment
    from vitserve.deployments.ingress import Ingress

    cfg = cfg.model_copy(update={"model": resolve_model(cfg.model)})
    check_model(cfg)
    cfg.log_effective()
    plain = cfg.model_dump()
    encoder = EncoderDeployment.options(**deployment_options(cfg.encoder)).bind(plain)
    preprocess = None
    if cfg.preprocess_at == "deployment":  # else no preprocess replicas at all
        preprocess = PreprocessDeployment.options(**deployment_options(cfg.preprocess)).bind(plain)
    return Ingress.options(**deployment_options(cfg.ingress)).bind(encoder, preprocess, plain)
