# The two set-up commands of the README: `make demo` (the main job) and `make test`.
# Both create .venv and install what they need on a fresh machine (once; again when
# pyproject.toml changes). TORCH pins the CPU build that lies on this kind of machine's disk;
# on a GPU machine pass e.g. TORCH='torch==2.13.0' from an index with CUDA builds.

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python

# The CPU profiles seen on machines of this kind, as LAST_LEVEL_CACHE:NATIVE_BF16: an AMD EPYC
# with an 8 MiB L3 and AVX2 only, a CPU with a 32 MiB L3 and AVX512-BF16, an AMX Xeon reporting
# a 480 MiB L3. `make test-profiles` runs the tests marked cpu_profile (batching, the service,
# the CLI) under each, as if on that CPU (VITSERVE_CPU_LLC_BYTES / VITSERVE_CPU_BF16, see
# encoder/device.py), so an outcome that leans on the host fails on every machine.
CPU_PROFILES ?= 8MiB:0 32MiB:1 480MiB:1

# Every test target writes pytest's junit XML, each test's time with its setup and teardown, to
# $(DURATIONS)/<target>.xml; `python3 -m tests.durations $(DURATIONS)/*.xml` prints the slowest
# tests and the totals per folder. .ci/run sets DURATIONS=loadtest/results/durations (kept).
DURATIONS ?= build/durations
JUNIT = --junitxml=$(DURATIONS)/$@.xml

.PHONY: install client-install demo test test-fast test-system test-large test-profiles test-min-versions test-vllm vllm-registry test-multinode test-gpu lint typecheck bench bench-publish bench-gpu readme docs

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet '$(TORCH)'
	$(PY) -m pip install --quiet -e '.[server,dev]'
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/vitserve demo

# The suite a developer runs before each commit: everything but the system tier (below), the
# fuzz tests at a fifth of their budget (tests/fuzz/budget.py). Its measured time, per target and
# per folder: loadtest/results/test-durations.md (docs/development.md).
test: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -m "not system" --durations=30 $(JUNIT)

# The system tier (a step of .ci/run): the tests tests/conftest.py lists in SYSTEM_TESTS, which
# start a whole cluster or server of their own, inject a fault or drive a load, and the fuzz tests
# again at their full budget (VITSERVE_TEST_FUZZ=full).
test-system: install
	VITSERVE_TEST_FUZZ=full $(PY) -m pytest -m "system or fuzz" --durations=30 $(JUNIT)

# The fast tier: every test that needs no Ray, Serve, Redis or process and is not slow (marked
# from their fixtures by tests/conftest.py), under a minute on 2 vCPUs. A run like this one,
# with no heavy test selected, makes ray.init, Redis connections and new processes fail the
# test that tries them, so the tier stays fast.
test-fast: install
	$(PY) -m pytest -q -m "not heavy and not slow and not system" $(JUNIT)

# The reliability table's 64-images-at-2K row: minutes on a CPU, so outside both tiers' time
# (tests/reliability/test_overload.py skips it unless VITSERVE_TEST_LARGE=1). It asserts memory,
# never time: .ci/run runs it at nice 19 beside its later steps.
test-large: install
	VITSERVE_TEST_LARGE=1 $(PY) -m pytest -q tests/reliability/test_overload.py -k 64_images $(JUNIT)

# The profile equal to this host's readings is left out: `make test` ran it (tests/cpu_profiles.py).
# The system tier's cpu_profile tests (the CLI demo, the service's overload and store-down
# tests) run once, in `make test-system`: each pins what a profile decides (dtype, batch cap,
# budget) in its own configuration, so a profile pass would only repeat them.
test-profiles: install
	@set -e; profiles=$$($(PY) -m tests.cpu_profiles $(CPU_PROFILES)); for profile in $$profiles; do \
	  llc=$${profile%%:*}; bf16=$${profile##*:}; \
	  echo "== CPU profile: last-level cache $$llc, native bf16 $$bf16"; \
	  VITSERVE_CPU_LLC_BYTES=$$llc VITSERVE_CPU_BF16=$$bf16 \
	    $(PY) -m pytest -q -m "cpu_profile and not system" --junitxml=$(DURATIONS)/$@-$$llc-$$bf16.xml; \
	done

# The minimum-versions job (a step of .ci/run): pyproject.toml's lower bounds are claims, so
# they are installed literally. tests/min_versions.py turns each `>=` bound of the base and
# `server` dependencies into an exact pin (ray[serve]>=2.60 -> ray==2.60) and pip installs the
# project under those pins into a venv of its own, MIN_VENV; a bound that is a lie fails the
# install or the tests by name (a resolver's "lowest" would quietly take a higher version, and
# uv's lowest-direct would take every dev tool at its lowest too). The dev tools, what the
# bounds do not reach and torch float: torch is TORCH, the build on this machine (a torch 2.6
# would be a CUDA build from the registry). Then the tests that run vitserve on Ray Serve and
# transformers for real at those versions: every family's towers and language models against
# transformers' own, the encoder application over HTTP (bad input, auth, fuzzed requests from
# FastAPI's OpenAPI), the request router and the autoscaling policy in Serve, the prefill
# application, the SDK and the LLM adapters against served applications. Measured on a 2-vCPU
# EPYC: 5:00 from no venv (the install 1:16, 340 tests 3:44). loadtest/compatibility.py lists
# what it ran with (loadtest/results/compatibility.md).
MIN_VENV ?= build/min-venv
MIN_TESTS ?= tests/test_families.py tests/encoder/test_families.py \
  tests/encoder/test_video_families.py tests/encoder/test_language_model.py \
  tests/encoder/test_loading.py tests/deployments/test_serve_app.py \
  tests/deployments/test_service.py tests/deployments/test_routing.py \
  tests/deployments/test_routing_serve.py tests/deployments/test_autoscaling.py \
  tests/deployments/test_bad_input.py tests/deployments/test_auth.py \
  tests/deployments/test_prefill.py tests/fuzz/test_api_fuzz.py \
  tests/client/test_client.py tests/client/test_adapters.py
$(MIN_VENV)/.installed: pyproject.toml tests/min_versions.py
	rm -rf $(MIN_VENV) && $(PYTHON) -m venv $(MIN_VENV)
	$(MIN_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(MIN_VENV)/bin/python -m pip install --quiet '$(TORCH)'
	$(PYTHON) -m tests.min_versions --extra server --float torch > $(MIN_VENV)/pins.txt
	$(MIN_VENV)/bin/python -m pip install --quiet -c $(MIN_VENV)/pins.txt -e '.[server,dev]'
	touch $@

test-min-versions: $(MIN_VENV)/.installed
	RAY_AUTH_MODE=disabled flock /tmp/vitserve-heavy.lock \
	  $(MIN_VENV)/bin/python -m pytest -q -m "not system" $(MIN_TESTS) $(JUNIT)

# The tests marked gpu (the CUDA paths: publishing from a CUDA tensor, the SDK's pinned-memory
# fetch, the budget from device memory, bf16 forwards batched vs alone), on a GPU machine (install
# a CUDA build of torch: TORCH above). Elsewhere they skip; here VITSERVE_REQUIRE_GPU=1 makes a
# missing or broken GPU fail them instead (tests/gpu.py).
test-gpu: install
	VITSERVE_REQUIRE_GPU=1 $(PY) -m pytest -q -m gpu $(JUNIT)

# vLLM's CPU build in its own venv (it pins its own torch and transformers), with vitserve's
# client installed into it; tests/vllm runs real vLLM servers from it beside `vitserve serve`.
VLLM_VENV ?= .venv-vllm
$(VLLM_VENV)/.installed: tests/vllm/make_env.sh tests/vllm/guard_torchvision.py pyproject.toml
	PYTHON=$(PYTHON) bash tests/vllm/make_env.sh $(VLLM_VENV)
	touch $@

# vLLM's model-info cache (~/.cache/vllm/modelinfos) filled for the test models' architectures,
# so no server tests/vllm starts pays its probe (tests/vllm/warm_registry.py). .ci/run runs it
# beside the system tier; without it the first server of each architecture probes.
vllm-registry: install $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/python tests/vllm/warm_registry.py $$($(PY) -m tests.vllm.families)

test-vllm: install $(VLLM_VENV)/.installed
	VITSERVE_TEST_VLLM=1 VITSERVE_VLLM_PYTHON=$(VLLM_VENV)/bin/python RAY_AUTH_MODE=disabled \
	  flock /tmp/vitserve-heavy.lock $(PY) -m pytest -q tests/vllm $(JUNIT)

# A real multi-node Ray cluster on this machine (tests/multinode: a head and three worker nodes,
# each its own raylet and object store), in a pytest process of its own; the Redis Cluster it
# stores in is .ci/run's (VITSERVE_TEST_REDIS_CLUSTER) or one the session starts.
test-multinode: install
	VITSERVE_TEST_MULTINODE=1 RAY_AUTH_MODE=disabled \
	  flock /tmp/vitserve-heavy.lock $(PY) -m pytest -q tests/multinode $(JUNIT)

# What `pip install vitserve` (no extras: the client an LLM server's nodes import) gives, in a
# venv of its own: the SDK imports without torch, ray or redis, `vitserve --version` answers
# and `vitserve --help` names the server extra (exit 2) instead of failing on an import. pip
# fetches the client's few dependencies; a step of .ci/run.
CLIENT_VENV ?= build/client-venv
client-install:
	rm -rf $(CLIENT_VENV) && $(PYTHON) -m venv $(CLIENT_VENV)
	$(CLIENT_VENV)/bin/python -m pip install --quiet .
	cd /tmp && $(CURDIR)/$(CLIENT_VENV)/bin/python -c "import sys, vitserve.client; \
	  heavy = {'torch', 'ray', 'redis', 'transformers', 'pydantic'} & set(sys.modules); \
	  assert not heavy, heavy"
	$(CLIENT_VENV)/bin/vitserve --version | grep -qx 'vitserve [0-9.]*'
	out=$$($(CLIENT_VENV)/bin/vitserve --help 2>&1); code=$$?; echo "$$out"; \
	  test "$$code" = 2 && echo "$$out" | grep -q "pip install 'vitserve\[server\]'"
	@echo "client-only install: the SDK imports, vitserve --version answers, --help names the extra"

lint: install typecheck
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# mypy over every package of vitserve ([tool.mypy] in pyproject.toml). The folders map to
# subpackages (encoder/ -> vitserve.encoder, ...) only when installed, which mypy cannot follow,
# so it reads them through a tree of links, build/typecheck/vitserve/, laid out as the installed
# package. Part of `make lint` and a step of .ci/run.
TYPECHECK_TREE := build/typecheck
TYPECHECKED ?= -p vitserve
typecheck: install
	@rm -rf $(TYPECHECK_TREE) && mkdir -p $(TYPECHECK_TREE)/vitserve
	@ln -s $(CURDIR)/vitserve/*.py $(CURDIR)/vitserve/families $(CURDIR)/vitserve/testing \
	  $(TYPECHECK_TREE)/vitserve/
	@for d in cache client deployments encoder; do ln -s $(CURDIR)/$$d $(TYPECHECK_TREE)/vitserve/$$d; done
	cd $(TYPECHECK_TREE) && $(CURDIR)/$(PY) -m mypy --config-file $(CURDIR)/pyproject.toml \
	  --cache-dir $(CURDIR)/build/.mypy_cache $(TYPECHECKED)

# The load-test harness (loadtest/harness): every scenario, short, against a `vitserve serve`
# it starts on loopback; one folder per scenario under loadtest/results/. Serialized with the
# other heavy runs on this machine by the lock.
BENCH_ARGS ?= --run-time 20
bench: install
	RAY_AUTH_MODE=disabled flock /tmp/vitserve-heavy.lock $(PY) -m loadtest.harness $(BENCH_ARGS)

# The harness's published figures: each point runs until it has lasted 60 s and answered 1,000
# requests (the publishing rule); hours on a 2-vCPU machine (a scenario at a time:
# SCENARIOS='random'). Then `make readme`.
SCENARIOS ?=
BENCH_PUBLISH_ARGS ?=
bench-publish: install
	RAY_AUTH_MODE=disabled flock /tmp/vitserve-heavy.lock $(PY) -m loadtest.harness $(SCENARIOS) $(BENCH_PUBLISH_ARGS)

# Bucketed vs per-image throughput on a real-size random-weight tower (Qwen2-VL's published
# ViT by default), on the GPU; writes loadtest/results/gpu-<card>.md. Refuses without CUDA
# (BENCH_GPU_ARGS='--device cpu --tiny' is a smoke run of the script). The first run builds and
# caches the model (~2.7 GB, under $$VITSERVE_CACHE or ~/.cache/vitserve).
BENCH_GPU_ARGS ?=
bench-gpu: install
	$(PY) loadtest/bench_gpu.py $(BENCH_GPU_ARGS)

# The documentation's generated sections (docs/benchmarks.md, reliability.md, development.md:
# the performance and reliability figures) from the results
# pages under loadtest/results/; tests/loadtest/test_readme_tables.py fails when they are stale.
# Standard library only: no venv needed.
readme:
	$(PYTHON) loadtest/readme_tables.py

# The documentation site (mkdocs.yml; docs/hooks.py joins README.md, k8s/README.md and the
# results pages to it) into build/site. --strict: a link to a page, anchor or repository file
# that does not exist fails the build (tests/docs/test_site.py shows one does). The reference
# pages are generated from the code first (docs/gen_reference.py). A step of .ci/run.
docs: install
	$(PY) docs/gen_reference.py --check
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet
