"""What every HTTP application of vitserve shares.

Lives here: the strict config (``config``), tenants and bearer tokens (``auth``), tenants'
request rates (``quota``), Prometheus
metrics (``metrics``), error answers (``responses``), bounded request-body reading
(``requests``), graceful stop (``lifecycle``), the model and Serve options every application
builder uses (``serving``), and the encoder clients of the applications that call the encoder
application through the SDK (``clients``).

May import: ``vitserve.errors``, ``vitserve.keys``, ``vitserve.cache``, ``vitserve.client``,
Ray Serve, FastAPI and Starlette; ``vitserve.encoder`` only inside the function that needs it
(its loaders pull in transformers). Never torch or transformers itself, and never another room
of ``vitserve.deployments``.
"""
