"""How vitserve is started on one machine: the ``vitserve`` CLI, the local cluster, the demo.

Lives here: the command line (``cli``), the embedded default (local Ray, node-local store, the
applications started and stopped gracefully: ``local``), and ``vitserve demo`` (``demo``).

May import: every room of ``vitserve.deployments`` and every vitserve package. No room imports
it. ``cli`` starts without torch or Ray (heavy imports happen inside the command that needs them).
"""
