# One image for every kvoffload process (offloadd, kv-bridge, kv-engine, kv-router, kv-ingest,
# kvctl, kv-stack). The defaults are what users pull; tests/compose builds it with other ones:
#   BASE_IMAGE   a Python >= 3.11 image whose `pip` installs into the image's environment
#   TORCH_INDEX  the index torch comes from (CPU build; engine-gpu in compose.yaml passes cu128)
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
# torch pinned and taken from the CPU index (override TORCH_INDEX for a CUDA build)
RUN pip install --index-url "$TORCH_INDEX" torch==2.13.0
COPY pyproject.toml README.md ./
COPY proto ./proto
# every package of the wheel (tests/e2e/test_compose.py checks the list against pyproject.toml)
COPY events ./events
COPY bridge ./bridge
COPY kvctl ./kvctl
COPY rpc ./rpc
COPY engine ./engine
COPY offloadd ./offloadd
COPY stack ./stack
COPY router ./router
COPY ingest ./ingest
RUN pip install ".[engine,plot]"
RUN useradd --create-home --uid 1000 kv
USER kv
CMD ["kvctl", "--help"]
