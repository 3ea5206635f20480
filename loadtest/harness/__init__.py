"""Load-test harness for vitserve (issues 14 and 29): closed-loop (locust) and open-loop
(Poisson) scenarios, a server runner, /metrics scraping, and the report (``stats.json``,
``report.md``, PNG plots) of each run, with goodput at two latency SLOs and the publishing rule
(>= 60 s and >= 1,000 requests per point) marked on every point.

    python -m loadtest.harness                      # all scenarios, each point to the rule
    python -m loadtest.harness random --users 1 2 4 --run-time 30   # short, below the rule
    python -m loadtest.harness open --rates 0.25 0.5   # Poisson arrivals, requests/s
    python -m loadtest.harness random --url http://encoder:8000   # an existing deployment
    python -m loadtest.harness chat --chat-url http://vllm:8001   # any OpenAI-compatible server

Modules: ``scenarios`` (pure: the requests each scenario sends), ``load`` (pure: run lengths,
the Poisson schedule, the users over time), ``measures`` (pure: percentiles, goodput, the
publishing rule, from per-request records), ``locustfile`` (the closed-loop users),
``openloop`` (the open-loop generator), ``chat`` (a streamed chat turn, TTFT), ``server``
(starts ``vitserve serve``, records replicas), ``monitor`` (/metrics and CPU sampling),
``promtext`` (Prometheus text parsing), ``report`` (tables and plots), ``run`` (the driver;
``__main__``).
"""
