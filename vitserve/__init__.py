"""vitserve: a disaggregated vision-encoder service.

The subpackages live in the repository's top-level folders: ``vitserve.encoder`` (model side),
``vitserve.cache`` (embedding stores), ``vitserve.client`` (the SDK an LLM server imports) and
``vitserve.deployments`` (Ray Serve, CLI). Importing ``vitserve`` itself loads nothing heavy.
"""

from vitserve.errors import VitserveError

__version__ = "0.1.0"
__all__ = ["VitserveError", "__version__"]
