"""The encoder application's builder: the vitserve Serve application from one strict config.

``build_app`` is what ``serve run vitserve.deployments.encoder.app:build_app model=demo`` and a
``serve build``-style YAML (``import_path: vitserve.deployments.encoder.app:build_app`` with
``args``) call. ``args`` are the config's fields; nested fields take dotted names
(``limits.max_images_per_request=16``) or nested mappings. ``build_application(config)`` is the
same from a ``VitserveConfig`` (the CLI, tests, benchmarks). The model ``demo`` is the small
random-weight model, built once into the cache folder; it is never used in place of a model
that failed to load.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from ray.serve.config import RequestRouterConfig

from vitserve.deployments.common.config import EncoderDeploymentConfig, VitserveConfig
from vitserve.deployments.common.serving import (
    as_deployment,
    check_model,
    deployment_options,
    resolve_model,
)
from vitserve.deployments.encoder.ingress import Ingress
from vitserve.deployments.encoder.preprocessing import PreprocessDeployment
from vitserve.deployments.encoder.replica import EncoderDeployment
from vitserve.deployments.encoder.request_router import (
    BACKOFF_S,
    ROUTER_PATH,
    STATS_PERIOD_S,
    STATS_TIMEOUT_S,
)


def build_app(args: Mapping[str, Any]):
    """The application from ``serve run``/YAML-style args (one parameter, as Serve requires):
    config fields, nested ones by dotted names or nested mappings; values may be strings."""
    return build_application(VitserveConfig.load(args))


# Ray's RequestRouterConfig pickles the router class by registering its module for pickling by
# value and unregistering it after, in process-wide state: two configs made at once in two
# threads (applications built in parallel) fail with "... is not registered for pickle by value".
_ROUTER_CONFIG_LOCK = threading.Lock()


def routing_options(encoder: EncoderDeploymentConfig) -> dict[str, Any]:
    """The encoder deployment's Serve options for its ``routing``: vitserve's request router
    with its replicas' routing stats read every ``STATS_PERIOD_S``, or none (Serve's own).
    Safe to call from several threads at once."""
    if encoder.routing == "serve-default":
        return {}
    with _ROUTER_CONFIG_LOCK:
        config = RequestRouterConfig(
            request_router_class=ROUTER_PATH,
            request_routing_stats_period_s=STATS_PERIOD_S,
            request_routing_stats_timeout_s=STATS_TIMEOUT_S,
            initial_backoff_s=BACKOFF_S[0],
            max_backoff_s=BACKOFF_S[1],
            request_router_kwargs={"hold_s": encoder.routing_hold_s},
        )
    return {"request_router_config": config}


def build_application(cfg: VitserveConfig):
    """The bound vitserve application for ``cfg``: ingress -> encoder, with the preprocess
    deployment between them when ``preprocess_at`` is ``deployment``."""
    cfg = cfg.model_copy(update={"model": resolve_model(cfg.model)})
    check_model(cfg)
    cfg.log_effective()
    plain = cfg.model_dump()
    encoder = (
        as_deployment(EncoderDeployment)
        .options(**deployment_options(cfg.encoder), **routing_options(cfg.encoder))
        .bind(plain)
    )
    preprocess = None
    if cfg.preprocess_at == "deployment":  # else no preprocess replicas at all
        preprocess = (
            as_deployment(PreprocessDeployment)
            .options(**deployment_options(cfg.preprocess))
            .bind(plain)
        )
    return (
        as_deployment(Ingress)
        .options(**deployment_options(cfg.ingress))
        .bind(encoder, preprocess, plain)
    )
