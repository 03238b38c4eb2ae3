# The raylane image: every node of a cluster (Ray head, Ray workers, MLflow server) runs the
# same code. CPU by default; for CUDA build with
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
FROM python:3.11-slim

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    MLFLOW_DISABLE_TELEMETRY=true

RUN apt-get update && apt-get install -y --no-install-recommends git curl \
    && rm -rf /var/lib/apt/lists/*
RUN pip install torch==2.13.0 --index-url "${TORCH_INDEX_URL}"

WORKDIR /opt/raylane
COPY pyproject.toml README.md ./
COPY platform ./platform
RUN pip install -e . psycopg2-binary
COPY serving ./serving
COPY pipelines ./pipelines
COPY configs ./configs
# `serving.app:app` (the Serve import path) resolves from here on every node.
ENV PYTHONPATH=/opt/raylane

RUN useradd --create-home raylane && chown -R raylane /opt/raylane
USER raylane
