"""What every application builder shares: the model it serves and its deployments' Serve options.

The encoder, prefill and vLLM-front builders (each room's ``app``) turn vitserve's checked config
into Serve options here, so a deployment is configured the same way in every application.

Invariants: the model ``demo`` is the small random-weight model, built once into the cache
folder, and never stands in for a model that failed to load; a model that cannot be read fails
the builder (:func:`check_model`), not replicas that retry; every replica process runs with
``WORKER_ENV``; autoscaling policy ``work`` always names :data:`WORK_POLICY`, with Serve's own
delays at 0 (the policy applies vitserve's).
"""

from __future__ import annotations

from typing import Any

from vitserve.deployments.common.config import AutoscalingConfig, DeploymentConfig, VitserveConfig

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
    from vitserve.testing.models import cached_model  # heavy: transformers

    return str(cached_model(DEMO_FAMILY, DEMO_PRESET))


def check_model(cfg: VitserveConfig) -> None:
    """Fail now, with the loader's clear error, if the model's config and image processor
    cannot be read or its family is unsupported, instead of after replicas retry to start.
    Reads no weights."""
    from vitserve.encoder.loading import load_preprocessor  # heavy: transformers

    load_preprocessor(cfg.model, revision=cfg.revision)


def as_deployment(cls: type) -> Any:
    """A ``@serve.deployment`` class as Serve made it: a ``Deployment``, with ``.options`` and
    ``.bind``. The builders reach their deployments through this because mypy, which does not
    read Ray, sees the decorated class as the plain class; at run time it is ``cls`` itself."""
    return cls


def deployment_options(d: DeploymentConfig) -> dict[str, Any]:
    """Serve deployment options from vitserve's checked subset."""
    options: dict[str, Any] = {
        "ray_actor_options": {
            "num_cpus": d.num_cpus,
            "num_gpus": d.num_gpus,
            "runtime_env": {"env_vars": WORKER_ENV},
            **({"resources": dict(d.resources)} if d.resources else {}),
        },
        "max_ongoing_requests": d.max_ongoing_requests,
        "max_queued_requests": d.max_queued_requests,
        "graceful_shutdown_wait_loop_s": d.graceful_shutdown_wait_loop_s,
    }
    if d.autoscaling is not None:
        options["autoscaling_config"] = serve_autoscaling_config(d.autoscaling)
    else:
        options["num_replicas"] = d.num_replicas
    return options


#: The encoder's patch-based policy (``vitserve.deployments.encoder.autoscaling``), by the import
#: path Serve's controller loads it from.
WORK_POLICY = "vitserve.deployments.encoder.autoscaling:work_policy"
#: Serve settings the work policy needs (not vitserve config fields): metrics reach the
#: controller every second (Serve's default is 10 s) and are averaged over the last 3 s
#: (default 30 s).
METRICS_INTERVAL_S = 1.0
LOOK_BACK_PERIOD_S = 3.0


def serve_autoscaling_config(a: AutoscalingConfig) -> dict[str, Any]:
    """Serve's ``autoscaling_config`` from vitserve's :class:`AutoscalingConfig` ``a``: policy
    ``requests`` is Serve's own (ongoing requests per replica), ``work`` the encoder's
    patch-based policy with its parameters in ``policy_kwargs``."""
    out: dict[str, Any] = {
        "min_replicas": a.min_replicas,
        "max_replicas": a.max_replicas,
        "target_ongoing_requests": a.target_ongoing_requests,
    }
    if a.policy == "requests":
        delays = {"upscale_delay_s": a.upscale_delay_s, "downscale_delay_s": a.downscale_delay_s}
        return out | delays
    kwargs = {
        "target_queue_delay_s": a.target_queue_delay_s,
        "upscale_delay_s": a.upscale_delay_s,
        "downscale_delay_s": a.downscale_delay_s,
    }
    return out | {
        "upscale_delay_s": 0.0,  # applied by the policy
        "downscale_delay_s": 0.0,
        "metrics_interval_s": METRICS_INTERVAL_S,
        "look_back_period_s": LOOK_BACK_PERIOD_S,
        "policy": {"policy_function": WORK_POLICY, "policy_kwargs": kwargs},
    }
