"""Load-test harness for vitserve (issue 14): locust scenarios, a server runner, /metrics
scraping, and the report (``stats.json``, ``report.md``, PNG plots) of each run.

    python -m loadtest.harness                      # all scenarios, short, loopback server
    python -m loadtest.harness random --users 1 2 4 --run-time 30
    python -m loadtest.harness random --url http://encoder:8000   # an existing deployment

Modules: ``scenarios`` (pure: the requests each scenario sends), ``locustfile`` (the locust
users), ``server`` (starts ``vitserve serve``, records replicas), ``monitor`` (/metrics and CPU
sampling), ``promtext`` (Prometheus text parsing), ``report`` (tables and plots), ``run``
(the driver; ``__main__``).
"""
