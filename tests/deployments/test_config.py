"""The service config: strict, environment-settable, and what build_app makes of it (no Ray)."""

from __future__ import annotations

import pytest

from vitserve.deployments.common.config import VitserveConfig
from vitserve.errors import ConfigError

pytestmark = pytest.mark.cpu_profile  # CI runs it again as on each CPU profile


def test_defaults_are_the_embedded_default() -> None:
    cfg = VitserveConfig.load(environ={})
    assert (cfg.model, cfg.store, cfg.http_port) == ("demo", "node://", 8000)
    assert cfg.encoder.max_ongoing_requests == 256 and cfg.ingress.num_cpus == 0.25
    assert cfg.batching.max_batch_patches is None  # the engine's default for its device


@pytest.mark.parametrize(
    "overrides, needle",
    [
        ({"encoder": {"max_ongoing_request": 5}}, "encoder.max_ongoing_request"),
        ({"batchng": {"enabled": False}}, "batchng"),
        ({"limits": {"max_images_per_request": 0}}, "limits.max_images_per_request"),
        ({"store": "memory://"}, "memory:// is private to one process"),
        ({"dtype": "int8"}, "unknown dtype 'int8'"),
        ({"encoder": {"num_gpus": -1}}, "encoder.num_gpus"),
    ],
)
def test_a_misspelled_or_invalid_field_is_an_error_naming_it(overrides, needle) -> None:
    with pytest.raises(ConfigError, match="invalid vitserve config") as info:
        VitserveConfig.load(overrides, environ={})
    assert needle in str(info.value)


def test_every_field_is_settable_by_environment_and_arguments_win() -> None:
    environ = {
        "VITSERVE_MODEL": "/models/qwen",
        "VITSERVE_STORE": "redis://cache:6379/0",
        "VITSERVE_LIMITS__MAX_IMAGES_PER_REQUEST": "16",
        "VITSERVE_BATCHING__ENABLED": "false",
        "VITSERVE_ENCODER__NUM_GPUS": "1",
        "VITSERVE_CACHE": "/not/a/config/field",  # the model cache folder, not config
        "VITSERVE_CPU_LLC_BYTES": "8MiB",  # host readings' overrides, not config either
        "VITSERVE_CPU_BF16": "0",
        "VITSERVE_BATCHING__MAX_BATCH_PATCHES": "4096",
        "PATH": "/usr/bin",
    }
    cfg = VitserveConfig.load({"limits": {"max_images_per_request": 32}}, environ=environ)
    assert cfg.model == "/models/qwen" and cfg.store == "redis://cache:6379/0"
    assert cfg.batching.enabled is False and cfg.batching.max_batch_patches == 4096
    assert cfg.limits.max_images_per_request == 32  # the argument over the environment
    # a partial section keeps the section's other defaults
    assert cfg.encoder.num_gpus == 1 and cfg.encoder.max_ongoing_requests == 256
    assert cfg.encoder.num_cpus == 1.0


def test_overrides_take_dotted_names_and_sections_together() -> None:
    cfg = VitserveConfig.load(
        {
            "limits.max_images_per_request": 5,
            "encoder": {"num_gpus": 1},
            "encoder.num_cpus": 2,
            "encoder.autoscaling.max_replicas": 4,
        },
        environ={},
    )
    assert cfg.limits.max_images_per_request == 5
    assert (cfg.encoder.num_gpus, cfg.encoder.num_cpus) == (1, 2)
    assert cfg.encoder.autoscaling.max_replicas == 4 and cfg.encoder.max_ongoing_requests == 256


def test_an_unknown_environment_variable_with_the_prefix_is_an_error() -> None:
    with pytest.raises(ConfigError, match="max_imagse"):
        VitserveConfig.load(environ={"VITSERVE_LIMITS__MAX_IMAGSE": "3"})
    # but for the variables that are not settings: the model cache, the test suite's own
    other = {
        "VITSERVE_CACHE": "/tmp/c",
        "VITSERVE_TEST_LARGE": "1",
        "VITSERVE_TEST_RELIABILITY_REPORT": "/tmp/r.md",
    }
    cfg = VitserveConfig.load(environ=other)
    assert cfg == VitserveConfig.load(environ={})


def test_config_is_frozen() -> None:
    cfg = VitserveConfig.load(environ={})
    with pytest.raises(Exception, match="frozen"):
        cfg.model = "other"  # type: ignore[misc]


def test_build_app_is_a_serve_application_builder_with_dotted_string_args(tiny_models) -> None:
    """What ``serve run vitserve.deployments.encoder.app:build_app k=v`` and a YAML ``args:`` do."""
    from ray.serve import Application
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    from vitserve.deployments.encoder.app import build_app

    model = str(tiny_models["qwen2_vl"])
    app = call_user_app_builder_with_args_if_necessary(
        build_app,
        {"model": model, "limits.max_images_per_request": "4", "encoder.num_replicas": "2"},
    )
    assert isinstance(app, Application)
    with pytest.raises(ConfigError, match=r"limits\.max_images"):
        build_app({"model": model, "limits.max_images": 4})


def test_the_prefill_application_builds_alone_with_its_own_section(tiny_models, tmp_path) -> None:
    """``serve run vitserve.deployments.prefill.app:build_app``: its own replicas and chunking."""
    from ray.serve import Application
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    from vitserve.deployments.prefill.app import build_app
    from vitserve.errors import ModelLoadError

    model = str(tiny_models["llava"])
    app = call_user_app_builder_with_args_if_necessary(
        build_app,
        {
            "model": model,
            "prefill.num_replicas": "3",
            "prefill.chunk_size": "64",
            "prefill.encoder_app": "encoders",
            "encoder.num_replicas": "2",
        },
    )
    assert isinstance(app, Application)
    deployment = app._bound_deployment
    assert deployment.name == "PrefillServer" and deployment.num_replicas == 3
    config = deployment.init_args[0]
    assert config["prefill"]["chunk_size"] == 64 and config["prefill"]["encoder_app"] == "encoders"
    with pytest.raises(ConfigError, match=r"prefill\.chunk"):
        build_app({"model": model, "prefill.chunk": 64})
    with pytest.raises(ModelLoadError, match="cannot load model"):
        build_app({"model": str(tmp_path / "missing")})


def test_build_app_refuses_a_model_that_cannot_load_before_anything_starts(tmp_path) -> None:
    from vitserve.deployments.encoder.app import build_app
    from vitserve.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="cannot load model"):
        build_app({"model": str(tmp_path / "missing")})
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text('{"model_type": "bert"}')
    (tmp_path / "bert" / "preprocessor_config.json").write_text("{}")
    with pytest.raises(ModelLoadError):
        build_app({"model": str(tmp_path / "bert")})


def test_every_metric_is_constructible_and_ray_prefix_is_stripped() -> None:
    from vitserve.deployments.common import metrics

    for name in metrics._SPECS:
        metrics.metric(name)
    page = (
        "# HELP ray_vitserve_images_encoded_total Images\n"
        "# TYPE ray_vitserve_images_encoded_total counter\n"
        'ray_vitserve_images_encoded_total{application="a"} 3.0\n'
        'ray_serve_num_http_requests_total{route="/"} 9.0\n'
    )
    assert metrics.vitserve_families(page) == (
        "# HELP vitserve_images_encoded_total Images\n"
        "# TYPE vitserve_images_encoded_total counter\n"
        'vitserve_images_encoded_total{application="a"} 3.0\n'
    )


def test_custom_resources_place_a_deployments_replicas() -> None:
    """``<section>.resources``: custom Ray resources each replica needs (which nodes may host
    it), from a mapping or the environment's JSON; CPU and GPU stay num_cpus/num_gpus."""
    from vitserve.deployments.common.serving import deployment_options

    cfg = VitserveConfig.load(
        {"encoder.resources": {"encoder_node": 1}},
        environ={"VITSERVE_PREFILL__RESOURCES": '{"prefill_node": 0.5}'},
    )
    assert deployment_options(cfg.encoder)["ray_actor_options"]["resources"] == {
        "encoder_node": 1.0
    }
    assert cfg.prefill.resources == {"prefill_node": 0.5}
    assert "resources" not in deployment_options(cfg.ingress)["ray_actor_options"]
    for bad in ({"GPU": 1}, {"x": -1}):
        with pytest.raises(ConfigError, match="resources"):
            VitserveConfig.load({"encoder.resources": bad})


def test_how_often_a_stopping_replica_checks_its_requests_is_serves_default_or_set() -> None:
    """``<section>.graceful_shutdown_wait_loop_s`` reaches Serve's deployment options: Serve's
    2 s unless set (a replica's stop takes at least that long), never 0 or below."""
    from vitserve.deployments.common.serving import deployment_options

    cfg = VitserveConfig.load(
        {"encoder.graceful_shutdown_wait_loop_s": 0.1},
        environ={"VITSERVE_VLLM__GRACEFUL_SHUTDOWN_WAIT_LOOP_S": "0.5"},
    )
    assert deployment_options(cfg.encoder)["graceful_shutdown_wait_loop_s"] == 0.1
    assert deployment_options(cfg.vllm)["graceful_shutdown_wait_loop_s"] == 0.5
    assert deployment_options(cfg.ingress)["graceful_shutdown_wait_loop_s"] == 2.0
    for bad in (0, -1):
        with pytest.raises(ConfigError, match="graceful_shutdown_wait_loop_s"):
            VitserveConfig.load({"prefill.graceful_shutdown_wait_loop_s": bad})


def test_a_cuda_device_reserves_a_gpu_per_encoder_replica() -> None:
    """``device: cuda`` gives each encoder replica a GPU of its own (num_gpus 1) unless the
    config names a share; an explicit 0 beside it is refused, naming why; cpu and the automatic
    device reserve none."""
    from vitserve.deployments.common.serving import deployment_options

    def gpus(overrides: dict, environ: dict | None = None) -> float:
        cfg = VitserveConfig.load(overrides, environ=environ or {})
        return deployment_options(cfg.encoder)["ray_actor_options"]["num_gpus"]

    assert gpus({"device": "cuda"}) == gpus({"device": "cuda:1"}) == 1.0
    assert gpus({"device": "cuda", "encoder.num_gpus": 0.5}) == 0.5
    assert gpus({"device": "cuda"}, {"VITSERVE_ENCODER__NUM_GPUS": "2"}) == 2.0
    assert gpus({}) == gpus({"device": "cpu"}) == 0.0
    assert gpus({"encoder.num_gpus": 1}) == 1.0  # the automatic device then takes the GPU
    assert VitserveConfig(device="cuda").encoder.num_gpus == 1.0
    assert VitserveConfig(device="cuda").encoder.max_ongoing_requests == 256  # the app's default
    with pytest.raises(ConfigError, match=r"encoder\.num_gpus 0"):
        VitserveConfig.load({"device": "cuda", "encoder.num_gpus": 0}, environ={})


def test_an_encoder_replica_uses_a_gpu_only_where_ray_reserved_one() -> None:
    from vitserve.deployments.encoder.replica import replica_device

    assert replica_device(None, []) == "cpu"  # GPUs visible or not: none is this replica's
    assert replica_device(None, ["0"]) == "cuda"
    assert replica_device("cuda:0", [3]) == "cuda:0"
    assert replica_device("cpu", ["0"]) == "cpu"
    with pytest.raises(ConfigError, match="reserved no GPU"):
        replica_device("cuda", [])
