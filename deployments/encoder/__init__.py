"""The encoder application: ``POST /v1/encode`` and friends, down to the device.

Lives here: the HTTP ingress (``ingress``) and its hash-first encode flow (``encode_flow``), the
encoder replicas (``replica``) and the store record they publish (``records``, Ray-free so the
GPU tests run without Ray), the preprocess replicas and preprocessing wherever it runs
(``preprocessing``), what crosses a process between them (``wire``: the ingress, the preprocess
and the encoder replicas import it, never each other), the one queue in front of the device
(``device_queue``), admission by work (``admission``), single flight across requests and
replicas (``single_flight``), the work-based autoscaling policy (``autoscaling``), the request
router by work and by key (``routing``, the policy; ``request_router``, Serve's hook that feeds
it), the application builder (``app``; Serve's ``import_path`` is
``vitserve.deployments.encoder.app:build_app``).

May import: ``vitserve.deployments.common``, ``vitserve.encoder``, ``vitserve.cache``,
``vitserve.errors``, ``vitserve.keys``. Never the prefill, vLLM or runner rooms.
"""
