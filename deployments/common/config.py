"""The service's one configuration object: strict, frozen, every field settable by environment.

Ray Serve's own config schema accepts misspelled keys silently (``max_ongoing_request``,
``num_gpu`` ...); vitserve's does not: every model here forbids unknown fields, so a typo in a
YAML file, a ``serve run`` argument or an environment variable is an error at start-up.

Environment: ``VITSERVE_<FIELD>`` for top-level fields and ``VITSERVE_<SECTION>__<FIELD>`` for
nested ones (``VITSERVE_MODEL=demo``, ``VITSERVE_LIMITS__MAX_IMAGES_PER_REQUEST=16``); values
are parsed as JSON when they parse, else taken as strings. Precedence: explicit arguments, then
environment, then defaults. An unknown ``VITSERVE_*`` variable is an error too, but for the
few that are not settings (``VITSERVE_CACHE``, the CPU-profile overrides) and the test suite's
own, ``VITSERVE_TEST_*``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from vitserve.encoder.device import DTYPES, HOST_OVERRIDE_VARS

if TYPE_CHECKING:
    from vitserve.encoder.images import ImageLimits
    from vitserve.encoder.video import VideoLimits
from vitserve.errors import ConfigError

ENV_PREFIX = "VITSERVE_"
log = logging.getLogger("ray.serve")  # where `serve run` and Serve's logs show it


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LimitsConfig(_Strict):
    """Per-request limits, enforced at the HTTP ingress before any work is done."""

    # The most items one request may carry (images, videos and keys together; a chat's image and
    # video parts): more is a 413, counted before any item is decoded.
    max_images_per_request: int = Field(64, gt=0)
    # The most bytes a request's body may take (the encoder's routes, the prefill and vLLM chat
    # routes), declared or as it arrives: a 413 once past it, before the rest is read.
    max_request_bytes: int = Field(64 * 2**20, gt=0)
    # The most bytes one image may take, as sent: a 413 for the request before the image is opened.
    max_image_bytes: int = Field(32 * 2**20, gt=0)
    # The most pixels (width * height, from its header) one image may have: a 413 before any decode.
    # It also sizes the costliest image the derived ``admission`` capacity must hold.
    max_image_pixels: int = Field(40_000_000, gt=0)
    # The most scans a JPEG may hold: each is a pass of the decoder over the image, and a file
    # of thousands (a few KB) costs seconds of CPU (vitserve.encoder.decode_work).
    max_jpeg_scans: int = Field(64, gt=0)
    # The most keys a /v1/probe body, or reads a /v1/rows body, may hold (413); their bodies are
    # also capped at about 4 KiB an item. The client SDK splits its probes and row reads by it.
    max_keys_per_probe: int = Field(1024, gt=0)
    # The most JSON values a chat body (/v1/chat/completions of the prefill app and the vLLM
    # front) may hold, counted before it is parsed (commas in the text count: an upper bound).
    # Parsed, each value costs ~100 bytes of Python objects: 40 MiB of "{}," would take over a
    # GiB; this bound keeps a parse to tens of MB.
    max_chat_json_values: int = Field(262_144, gt=0)
    # The most row bytes one /v1/rows answer may carry (every read counted, repeats included),
    # checked from the reads' row counts at the model's row size before the store is asked.
    max_rows_bytes: int = Field(64 * 2**20, gt=0)
    # The most a request's body may take to arrive (a slower client is answered 408).
    body_timeout_s: float = Field(30.0, gt=0)
    # Videos (a request's items count images and videos together). What a video's decode
    # costs is its header's frames times pixels, checked before any frame is decoded
    # (vitserve.encoder.video); the work of its sampled frames is admitted like an image's.
    max_videos_per_request: int = Field(8, gt=0)
    # The most bytes one video may take, as sent: a 413 before its header is read.
    max_video_bytes: int = Field(64 * 2**20, gt=0)
    # The longest a video may run, in seconds, by its container header's duration (413).
    max_video_seconds: float = Field(600.0, gt=0)
    max_video_frames: int = Field(36_000, gt=0)  # frames the header counts: what a decode walks
    # The most pixels (width * height) of one video frame, by its header (413).
    max_frame_pixels: int = Field(3840 * 2160, gt=0)

    def image_limits(self) -> ImageLimits:
        """The per-image limits every decode and header read runs under."""
        from vitserve.encoder.images import ImageLimits  # PIL: only where images are read

        return ImageLimits(
            max_image_bytes=self.max_image_bytes,
            max_image_pixels=self.max_image_pixels,
            max_jpeg_scans=self.max_jpeg_scans,
        )

    def video_limits(self) -> VideoLimits:
        """The per-video limits every probe and decode runs under."""
        from vitserve.encoder.video import VideoLimits  # numpy only; PyAV loads at a decode

        return VideoLimits(
            max_video_bytes=self.max_video_bytes,
            max_video_seconds=self.max_video_seconds,
            max_video_frames=self.max_video_frames,
            max_frame_pixels=self.max_frame_pixels,
        )


class AdmissionConfig(_Strict):
    """The work one encoder replica admits at once (``vitserve.deployments.encoder.admission``):
    patches, and bytes (prepared pixel arrays and the decodings under way), both taken from
    each image's header before it is decoded. None: derived from the activation budget
    (``vitserve.encoder.work.Capacity.derived``)."""

    # The most patches one encoder replica holds admitted (queued or on the device); None:
    # ``QUEUE_FORWARDS`` (4) full forwards under the activation budget, at least the costliest
    # image's.
    max_patches: int | None = Field(None, gt=0)
    # The most bytes (prepared pixel arrays plus decodings under way) one encoder replica holds
    # admitted; None: ``budget_bytes``, at least what the costliest image needs.
    max_bytes: int | None = Field(None, gt=0)


class BatchingConfig(_Strict):
    """How the encoder's device queue forms forwards.

    See vitserve.deployments.encoder.device_queue.
    """

    # Off: each device step (and forward) takes one image, and ``batch_wait_timeout_s`` is unused.
    enabled: bool = True
    # The most patches one device step (and one tower forward) takes. None: the
    # engine's default, sized to the CPU's last-level cache on a CPU, uncapped on a GPU (see
    # vitserve.encoder.device).
    max_batch_patches: int | None = Field(None, gt=0)
    # 0: no image waits for company when the device is free; images that arrive while it is
    # busy are gathered into its next forward anyway (the encoder's device queue).
    batch_wait_timeout_s: float = Field(0.0, ge=0)


class AutoscalingConfig(_Strict):
    """Serve autoscaling of one deployment, by one of two signals (``policy``):

    * ``requests``: Serve's own policy, ongoing requests per replica against
      ``target_ongoing_requests``. Right when requests cost about the same.
    * ``work`` (the encoder): the replicas' queued and running patches against their measured
      patch throughput, sized so a new image waits about ``target_queue_delay_s``
      (``vitserve.deployments.encoder.autoscaling``). Requests that differ 100x in patches do not
      mis-size it.

    A change of replica count must be wanted for ``upscale_delay_s`` / ``downscale_delay_s``
    before it is applied (both policies).
    """

    # The signal (see above). ``work`` reads the patches encoder replicas report: on another
    # deployment it never measures a throughput, so it keeps the replica count where it is.
    policy: Literal["requests", "work"] = "requests"
    # The fewest replicas autoscaling keeps running (Serve's ``min_replicas``).
    min_replicas: int = Field(1, ge=0)
    # The most replicas autoscaling may run; the default 1, with ``min_replicas`` 1, never scales.
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: float = Field(8.0, gt=0)  # policy "requests"
    target_queue_delay_s: float = Field(2.0, gt=0)  # policy "work"
    # Seconds a scale-up must be wanted, tick after tick, before it is applied.
    upscale_delay_s: float = Field(5.0, ge=0)
    # Seconds a scale-down must be wanted, tick after tick, before it is applied.
    downscale_delay_s: float = Field(60.0, ge=0)


class DeploymentConfig(_Strict):
    """Resources and scaling of one deployment (the subset vitserve exposes, checked)."""

    # Replicas to run while ``autoscaling`` is None (unused when it is set).
    num_replicas: int = Field(1, ge=1)
    # Serve autoscaling of this deployment (between its ``min_replicas`` and ``max_replicas``);
    # None: a fixed ``num_replicas``.
    autoscaling: AutoscalingConfig | None = None
    # CPUs Ray reserves for each replica (a fraction: replicas share a core).
    num_cpus: float = Field(1.0, ge=0)
    # GPUs Ray reserves for each replica (a fraction: replicas share one).
    num_gpus: float = Field(0.0, ge=0)
    # Custom Ray resources each replica needs (``{"encoder_node": 1}``): which nodes may host
    # it. CPU, GPU and memory are num_cpus, num_gpus and Ray's own.
    resources: dict[str, float] = Field(default_factory=dict)
    # The most calls one replica runs at once (Serve's); more wait in their callers' queues. The
    # vLLM front also caps its connections to each vLLM server at it.
    max_ongoing_requests: int = Field(64, gt=0)
    max_queued_requests: int = Field(256, ge=-1)  # -1: unbounded (not recommended)
    # How often a stopping replica checks that its requests in flight are done (Serve's
    # graceful_shutdown_wait_loop_s): a replica's stop takes at least this long.
    graceful_shutdown_wait_loop_s: float = Field(2.0, gt=0)

    @field_validator("resources")
    @classmethod
    def _custom_resources(cls, value: dict[str, float]) -> dict[str, float]:
        for name, amount in value.items():
            if name in ("CPU", "GPU", "memory", "object_store_memory"):
                raise ValueError(f"{name} is not a custom resource: use num_cpus/num_gpus")
            if not name or amount < 0:
                raise ValueError(f"resource {name!r}: a name and an amount >= 0")
        return value


#: The longest a call waits in vitserve's encoder router for a replica with room
#: (``encoder.routing_hold_s``; ``vitserve.deployments.encoder.routing``).
DEFAULT_ROUTING_HOLD_S = 1.0


class EncoderDeploymentConfig(DeploymentConfig):
    """The encoder deployment's: also how its callers' calls are routed to its replicas.
    ``work``: vitserve's router (``vitserve.deployments.encoder.routing``: by queued patches,
    each image key kept on a stable replica while its load allows, a call that finds no
    replica with room held in the router for up to ``routing_hold_s``, then answered by the
    least loaded replica's admission; the default); ``serve-default``: Serve's power of two
    choices on ongoing calls."""

    # How callers' calls reach the encoder's replicas: ``work`` or ``serve-default`` (see above).
    routing: Literal["work", "serve-default"] = "work"
    # Seconds a call may wait in the ``work`` router for a replica with room before it goes to the
    # least loaded replica, whose admission admits it or answers 429.
    routing_hold_s: float = Field(DEFAULT_ROUTING_HOLD_S, ge=0)
    # None: one GPU per replica when ``device`` is cuda, else none (VitserveConfig resolves it)
    num_gpus: float | None = Field(None, ge=0)  # type: ignore[assignment]


class EncoderAccessConfig(DeploymentConfig):
    """How an application that calls the encoder application through the client SDK (the
    prefill application, the vLLM front) reaches it, and its store."""

    # The encoder application, by its name in this Ray cluster (reached by its ingress's
    # handle), or over HTTP when ``encoder_url`` is set.
    encoder_app: str = "vitserve"
    # The encoder application's base URL (``http://host:8000``), called over HTTP; None: by the
    # handle of ``encoder_app``. ``vitserve serve`` always uses the handle.
    encoder_url: str | None = None
    # Read the store directly (the fast path; the store must be reachable from the
    # application's replicas), else through the encoder's API.
    direct_store: bool = True
    # The store URL of those direct reads; None: ``store``. Set it to give the application
    # credentials that can only read (a Redis ACL reader user; see k8s/README.md).
    store: str | None = None
    # Tries of an encoder or store call that can be retried (a replica restarting, 429, a
    # store down), backing off from 50 ms to 1 s: the default rides out a replica restart
    # (~20 s) instead of failing the request.
    encoder_attempts: int = Field(30, ge=1)

    @field_validator("store")
    @classmethod
    def _store(cls, value: str | None) -> str | None:
        return None if value is None else shared_store(value)


class PrefillConfig(EncoderAccessConfig):
    """The prefill application (``vitserve.deployments.prefill.app``): its replicas (the fields
    of every deployment, scaled apart from the encoder's), its chunking and how it reaches the
    encoder application (rows read from the store directly unless ``direct_store`` is off:
    then through the encoder's ``/v1/rows``). It serves the same ``model`` (its language model
    only)."""

    chunk_size: int = Field(512, gt=0)  # prompt tokens per prefill forward
    # The path ``vitserve serve`` mounts the prefill application at (its routes are under it);
    # ``serve run`` and ``serve deploy`` take their own.
    route_prefix: str = "/prefill"
    # The name requests give as ``model`` (and answers carry); None: ``model`` as configured.
    served_model_name: str | None = None
    max_tokens: int = Field(256, gt=0)  # the completion budget of a request that names none


class VllmFrontConfig(EncoderAccessConfig):
    """The vLLM front (``vitserve.deployments.vllm.app``): an OpenAI-compatible route that
    encodes a chat's images through vitserve and forwards the chat to one of the vLLM OpenAI
    servers at ``urls`` (round robin), its images named by their vitserve keys. Probes read
    the store directly unless ``direct_store`` is off."""

    # The vLLM servers' base URLs (``http://host:8000``); a string is split on commas
    # (``VITSERVE_VLLM__URLS=http://a:8000,http://b:8000``).
    urls: list[str] = []
    # The path ``vitserve serve`` mounts the vLLM front at (its routes are under it); ``serve run``
    # and ``serve deploy`` take their own.
    route_prefix: str = "/vllm"
    # Sent to vLLM as ``Authorization: Bearer <api_key>`` (vLLM's ``--api-key``); None: no
    # Authorization header (the caller's is never forwarded).
    api_key: SecretStr | None = None
    connect_timeout_s: float = Field(5.0, gt=0)  # to open a connection to a vLLM server
    read_timeout_s: float = Field(600.0, gt=0)  # between two reads of its answer
    retry_after_s: int = Field(1, ge=0)  # the Retry-After of a 503 when no vLLM answers
    # How often each vLLM server's /metrics is read again for vitserve's connector (a server
    # restarted without it takes no chat: vitserve.deployments.vllm.backends)
    check_s: float = Field(30.0, gt=0)
    # An image part whose URL is not a data: URL (https://...): vitserve cannot key it. refuse
    # (422, the default) or forward it to vLLM unkeyed (vLLM fetches and encodes it; counted in
    # x-vitserve-unkeyed and vitserve_vllm_front_images_total{kind="unkeyed"})
    remote_media: Literal["refuse", "forward"] = "refuse"
    # Hand vLLM the chat once its new images are claimed (the encode then runs beside vLLM's
    # own work on the request; its connector waits for each chunk's images: it needs a direct
    # ``store`` to see the claims), not once they are published. None (the default): on when
    # the encoder has compute of its own (GPU encoder replicas: ``device`` cuda, or
    # ``encoder.num_gpus`` > 0), off when it shares CPU cores with vLLM: a vLLM request held
    # back keeps vLLM's engine stepping and its worker spinning, which on shared cores slows
    # the very encode it waits for (loadtest/results/vllm-cpu.md).
    overlap: bool | None = None

    @field_validator("urls", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [url.strip() for url in value.split(",") if url.strip()]
        return value

    @field_validator("urls")
    @classmethod
    def _urls(cls, value: list[str]) -> list[str]:
        out = []
        for url in value:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"{url!r} is not an http(s) URL (http://host:port)")
            parts.port  # noqa: B018 (a port that is not a number raises ValueError here)
            if parts.query or parts.fragment:
                raise ValueError(f"{url!r}: a vLLM server's base URL takes no query or fragment")
            out.append(url.rstrip("/"))
        return out


def shared_store(url: str) -> str:
    """``url``, if a store the service's processes can share (not ``memory://``)."""
    if url.startswith("memory:"):
        raise ValueError(
            "memory:// is private to one process; the service's replicas share a store: "
            "use node:// (the embedded default), redis://... or tiered://"
        )
    return url


class SingleFlightConfig(_Strict):
    # Seconds a claim on a new image lasts in the store (others wait for the claimant's publish
    # until then); also the longest a stopping encoder replica waits for its last publishes.
    claim_ttl_s: float = Field(60.0, gt=0)
    # The longest (seconds) an encoder replica waits for an image another claimant encodes, before
    # it claims and encodes the image itself.
    wait_timeout_s: float = Field(60.0, gt=0)


TENANT_RE = r"^[A-Za-z0-9_-]{1,64}$"
MIN_TOKEN_CHARS = 16


class TokenConfig(_Strict):
    """One bearer token and the tenant it authenticates (a tenant may have several: rotation)."""

    # The tenant the token authenticates: its keys live in its own namespace (see ``auth``).
    tenant: str = Field(pattern=TENANT_RE)
    token: SecretStr  # masked in the effective-config log and in every dump as JSON

    @field_validator("token")
    @classmethod
    def _long_enough(cls, value: SecretStr) -> SecretStr:
        if len(value.get_secret_value()) < MIN_TOKEN_CHARS:
            raise ValueError(f"a token needs at least {MIN_TOKEN_CHARS} characters")
        return value


class QuotaConfig(_Strict):
    """A tenant's request rate (vitserve.deployments.common.quota), the same for every tenant;
    off unless set. Over it a request is answered 429 naming the quota (QuotaExceededError):
    a token bucket per tenant in each ingress replica (so the service-wide rate is this times
    the ingress replicas), ``burst`` requests at once. A tenant's byte share of the store is the
    store URL's ``share_bytes`` (``node://?share_bytes=1GiB``; vitserve.cache.urls)."""

    # Each tenant's average request rate (requests/s) in each replica that authenticates it (the
    # ingress, the prefill and vLLM fronts); None: no quota. Needs auth on (else a start error).
    requests_per_s: float | None = Field(None, gt=0)
    burst: int | None = Field(None, gt=0)  # None: max(1, requests_per_s)

    @property
    def bucket(self) -> int:
        """The bucket's size: ``burst``, else one second's worth (at least 1)."""
        if self.burst is not None:
            return self.burst
        return max(1, int(self.requests_per_s or 1))


class AuthConfig(_Strict):
    """Bearer-token auth of the HTTP API and the ingress handle (vitserve.deployments.common.auth).

    Off unless a token is configured, in ``tokens`` or in ``tokens_file`` (one ``tenant:token``
    per line, ``#`` comments: fit for a mounted Kubernetes Secret; each replica re-reads it when
    its content changes, looking every ``reload_s`` seconds, so a token added or removed takes
    effect within ``reload_s`` of the file changing, without a restart). Each tenant's keys
    live in the namespace ``<namespace>.<tenant>`` (``<tenant>`` when ``namespace`` is empty),
    followed by ``.<tag>`` when ``key_secret`` is set.

    ``scrape_token`` / ``scrape_token_file``: with auth on, ``/metrics`` answers only this
    bearer token (Prometheus'), no tenant's; with none configured it answers no one.
    ``key_secret`` / ``key_secret_file``: a server secret mixed into every namespace (a tag,
    HMAC-SHA256 of the namespace), so content keys cannot be computed from outside from an image
    and the fingerprint; a caller learns its own namespace from ``/healthz`` with its token. The
    cost: keys differ between deployments with different secrets (their stores share nothing),
    and a changed secret turns every stored entry into a miss.
    """

    # Bearer tokens and their tenants, given inline; ``tokens_file``'s lines count too.
    tokens: list[TokenConfig] = []
    # A file of ``tenant:token`` lines (``#`` comments), followed while replicas run (``reload_s``).
    tokens_file: str | None = None
    # Seconds between a replica's looks at ``tokens_file`` and ``scrape_token_file`` (on a request).
    reload_s: float = Field(5.0, gt=0)
    # The one bearer token ``/metrics`` and ``/v1/stats`` answer with auth on (16 characters or
    # more); with neither it nor ``scrape_token_file``, they answer no one.
    scrape_token: SecretStr | None = None
    # A file holding the scrape token instead (stripped), followed like ``tokens_file``.
    scrape_token_file: str | None = None
    # A server secret (16 characters or more) that tags each tenant's namespace (see above);
    # needs auth on (with auth off, a replica refuses to start).
    key_secret: SecretStr | None = None
    # A file holding ``key_secret`` instead (stripped), read once when each replica starts.
    key_secret_file: str | None = None
    quota: QuotaConfig = QuotaConfig()

    @property
    def enabled(self) -> bool:
        return bool(self.tokens) or self.tokens_file is not None

    @field_validator("scrape_token", "key_secret")
    @classmethod
    def _secret_long_enough(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < MIN_TOKEN_CHARS:
            raise ValueError(f"needs at least {MIN_TOKEN_CHARS} characters")
        return value

    @model_validator(mode="after")
    def _one_tenant_per_token(self) -> AuthConfig:
        seen: set[str] = set()
        for entry in self.tokens:
            secret = entry.token.get_secret_value()
            if secret in seen:
                raise ValueError("a token is configured twice (each names one tenant)")
            seen.add(secret)
        if self.scrape_token is not None and self.scrape_token_file is not None:
            raise ValueError("scrape_token and scrape_token_file: give one")
        if self.key_secret is not None and self.key_secret_file is not None:
            raise ValueError("key_secret and key_secret_file: give one")
        return self


class VitserveConfig(_Strict):
    """Everything a vitserve application needs; see the module docstring for the environment."""

    # The model served: a Hugging Face id or a local folder; ``demo``: a small random-weight
    # model, built once into the cache folder.
    model: str = "demo"
    # The Hugging Face revision (branch, tag or commit) of ``model``; None: its default branch.
    # Unused for a local folder.
    revision: str | None = None
    # None: cuda in a replica Ray gave a GPU (encoder.num_gpus > 0), else cpu; cuda reserves
    # one GPU per encoder replica unless encoder.num_gpus says otherwise
    device: str | None = None
    # fp32|bf16|fp16, or vLLM's spellings float32|bfloat16|float16; None or "auto": bf16 where
    # native, else fp32
    dtype: str | None = None
    store: str = "node://"  # any open_store URL
    # Mixed into every content key, and the prefix of the store's entries: with auth off every
    # request's namespace; with auth on, each tenant's is derived from it (see ``auth``).
    namespace: str = ""
    # The encoder's activation budget (bytes): what one forward's activations may take, and the
    # default of ``admission.max_bytes``. None: half the GPU's free memory (a CPU: a quarter of
    # MemAvailable), read as the replica starts.
    budget_bytes: int | None = Field(None, gt=0)
    torch_threads: int | None = Field(None, gt=0)  # None: the cores the container may use
    batching: BatchingConfig = BatchingConfig()
    # Where images are decoded and preprocessed: in the encoder replica's CPU threads (the
    # bytes travel, the pixels never leave the replica), in the ingress, or in the preprocess
    # deployment (CPU replicas that scale apart from the encoders). See the README.
    preprocess_at: Literal["encoder", "ingress", "deployment"] = "encoder"
    limits: LimitsConfig = LimitsConfig()
    admission: AdmissionConfig = AdmissionConfig()
    single_flight: SingleFlightConfig = SingleFlightConfig()
    encoder: EncoderDeploymentConfig = EncoderDeploymentConfig(
        num_cpus=1.0, max_ongoing_requests=256
    )
    preprocess: DeploymentConfig = DeploymentConfig(num_cpus=0.5)
    ingress: DeploymentConfig = DeploymentConfig(num_cpus=0.25, max_ongoing_requests=128)
    prefill: PrefillConfig = PrefillConfig(num_cpus=0.5, max_ongoing_requests=16)
    # I/O only (an HTTP relay): a small CPU share, many requests (streams) in flight
    vllm: VllmFrontConfig = VllmFrontConfig(num_cpus=0.25, max_ongoing_requests=256)
    # The address ``vitserve serve`` has Serve listen on: beyond loopback it refuses to start with
    # auth off (unless ``--insecure``). ``serve run`` and ``serve deploy`` use Serve's own.
    http_host: str = "127.0.0.1"
    # The port ``vitserve serve`` has Serve listen on (0: a free one).
    http_port: int = Field(8000, ge=0, le=65535)
    # Serve's ``enable_access_log`` for what ``vitserve serve`` starts (its log level is WARNING).
    access_log: bool = False
    auth: AuthConfig = AuthConfig()

    @field_validator("store")
    @classmethod
    def _store(cls, value: str) -> str:
        return shared_store(value)

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, value: str | None) -> str | None:
        if value is None or value.lower() == "auto":
            return None
        if value.lower() not in DTYPES:
            raise ValueError(
                f"unknown dtype {value!r}; use auto, bfloat16, float16 or float32 "
                "(or bf16, fp16, fp32)"
            )
        return value

    @model_validator(mode="before")
    @classmethod
    def _cuda_reserves_a_gpu(cls, data: Any) -> Any:
        """``device: cuda`` (or ``cuda:N``) reserves a GPU for each encoder replica: Ray then
        gives the replica its own (``encoder.num_gpus`` 1 unless set: a fraction shares one);
        an explicit 0 is refused, as every replica would run on a GPU Ray did not reserve."""
        if not isinstance(data, dict):
            return data
        cuda = str(data.get("device") or "").startswith("cuda")
        encoder = data.get("encoder", cls.model_fields["encoder"].default)
        section = encoder.model_dump() if isinstance(encoder, BaseModel) else dict(encoder)
        if section.get("num_gpus") is None:
            return {**data, "encoder": {**section, "num_gpus": 1.0 if cuda else 0.0}}
        if cuda and not section["num_gpus"]:
            raise ValueError(
                f"device {data['device']!r} with encoder.num_gpus 0: every encoder replica "
                "would run on a GPU Ray did not reserve for it (cuda:0, shared with whatever "
                "Ray put there). Set encoder.num_gpus (1: a GPU each; a fraction: replicas "
                "share one) or device cpu"
            )
        return data

    @classmethod
    def load(
        cls, overrides: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
    ) -> VitserveConfig:
        """Defaults, then ``VITSERVE_*`` environment, then ``overrides``.

        Overrides name nested fields by dotted names (``"limits.max_images_per_request"``), by
        nested mappings, or both. A partial section (``{"encoder": {"num_gpus": 1}}``) keeps
        the section's other fields at this config's defaults, not at the section class's.
        """
        data: dict[str, Any] = cls().model_dump()
        data["encoder"]["num_gpus"] = None  # derived from the device unless set (see below)
        for name, raw in (os.environ if environ is None else environ).items():
            if name.startswith(ENV_PREFIX) and not _not_config(name):
                _assign(data, name[len(ENV_PREFIX) :].lower().split("__"), parse_value(raw))
        for name, value in (overrides or {}).items():
            _assign(data, name.split("."), value)
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
            )
            raise ConfigError(f"invalid vitserve config: {problems}") from None

    def effective_json(self) -> str:
        """The configuration as one line of JSON with every secret masked: the password of
        every URL (``redis://user:***@host``, nested ``tiered://`` URLs too; see
        ``vitserve.cache.urls.redact_url``) and every ``SecretStr`` (``**********``)."""
        # heavy (numpy, msgpack): vitserve.cache loads them; the CLI imports this module
        from vitserve.cache.urls import redact_url

        def masked(value: Any) -> Any:
            if isinstance(value, str):
                return redact_url(value)
            if isinstance(value, dict):
                return {masked(k): masked(v) for k, v in value.items()}
            if isinstance(value, list):
                return [masked(v) for v in value]
            return value

        data = masked(self.model_dump(mode="json"))
        return json.dumps(data, separators=(",", ":"), ensure_ascii=False)

    def log_effective(self) -> None:
        """Log the effective configuration once (JSON, one line, secrets masked)."""
        log.info("vitserve effective config: %s", self.effective_json())


# Environment variables that share the prefix but are not config fields.
_NOT_CONFIG = {"VITSERVE_CACHE", *HOST_OVERRIDE_VARS}
TEST_PREFIX = "VITSERVE_TEST_"  # the test suite's own variables (tests/)


def _not_config(name: str) -> bool:
    return name in _NOT_CONFIG or name.startswith(TEST_PREFIX)


def parse_value(raw: str) -> Any:
    """A value given as text (environment, ``--set``): JSON when it parses, else the text."""
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _assign(tree: dict[str, Any], path: list[str], value: Any) -> None:
    """Set ``tree[path[0]]...[path[-1]]``; a mapping merges into the section already there."""
    node = tree
    for part in path[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    leaf = path[-1]
    if isinstance(value, Mapping) and isinstance(node.get(leaf), dict):
        for key, sub in value.items():
            _assign(node[leaf], [key], sub)
    else:
        node[leaf] = value
