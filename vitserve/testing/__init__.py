"""vitserve.testing: the test helpers that ship, for the command line, the demo and benchmarks.

* :mod:`vitserve.testing.models`: random-weight vision-language models built offline (``vitserve
  make-model``, the ``demo`` model, the benchmarks' and the tests' models);
* :mod:`vitserve.testing.images`: synthetic images (the demo's, the benchmarks') and work bombs;
* :mod:`vitserve.testing.records`: random embedding records (the store benchmarks').

Nothing of vitserve.encoder, vitserve.cache or vitserve.client imports it, and in
vitserve.deployments only what builds test models or runs the demo (the CLI, the demo, the
``demo`` model's builder); ``tests/test_layering.py`` checks it. Helpers only the tests use live
in ``tests/``. Importing this package imports none of its modules.
"""
