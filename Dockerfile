# syntax=docker/dockerfile:1
# The vitserve image for the KubeRay manifests in k8s/: Ray's own image (its `ray` user,
# uid 1000, its Python 3.11) plus torch and vitserve with the server and redis extras.
#
#   docker build --build-arg VARIANT=gpu -t registry.example.com/ml/vitserve:0.1.0-gpu .
#   docker build --build-arg VARIANT=cpu -t registry.example.com/ml/vitserve:0.1.0-cpu .
#
# VARIANT picks the base: rayproject/ray:2.60.0-py311 (CPU) or -py311-gpu (CUDA), and the
# torch wheels: the CPU index for cpu, PyPI's default CUDA build for gpu. BuildKit builds only
# the stage the chosen VARIANT needs.
ARG VARIANT=gpu

FROM rayproject/ray:2.60.0-py311 AS base-cpu
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

FROM rayproject/ray:2.60.0-py311-gpu AS base-gpu
ENV TORCH_INDEX_URL=https://pypi.org/simple

# hadolint ignore=DL3006
FROM base-${VARIANT}
ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/home/ray/.cache/huggingface
# The Ray image's own non-root user, `ray` (uid 1000, group `users`, gid 100).
USER 1000
WORKDIR /home/ray/vitserve

RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

# The project's sources only (see .dockerignore); installed, not editable.
COPY --chown=1000:100 pyproject.toml README.md ./
COPY --chown=1000:100 vitserve ./vitserve
COPY --chown=1000:100 encoder ./encoder
COPY --chown=1000:100 cache ./cache
COPY --chown=1000:100 client ./client
COPY --chown=1000:100 deployments ./deployments
# Pinned: Ray stays the base image's 2.60.0, the rest at the versions the project is tested with.
RUN pip install "/home/ray/vitserve[server,redis]" \
        "ray[serve]==2.60.0" \
        "transformers==5.23.0" \
        "redis==8.1.0" \
        "pydantic==2.14.3" \
        "fastapi==0.165.0" \
        "safetensors==0.8.0" \
        "pillow==13.0.0" \
        "numpy==2.4.6" \
    && python -c "import vitserve.deployments.encoder.app, vitserve.deployments.prefill.app"

WORKDIR /home/ray
