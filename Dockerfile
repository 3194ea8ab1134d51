# One image for every kvoffload process (offloadd, kv-bridge, kv-engine, kv-router, kv-ingest,
# kvctl, kv-stack). The defaults are what users pull; tests/compose builds it with other ones:
#   BASE_IMAGE   a Python >= 3.11 image whose `pip` installs into the image's environment
#   TORCH_INDEX  the index torch comes from (CPU build; engine-gpu in compose.yaml passes cu128)
# Layers, slowest-changing first: torch; the other dependencies, listed from pyproject.toml by a
# stage of their own (only a change of the list itself installs them again); the sources,
# installed without dependencies, so a source change rebuilds that last layer alone.
ARG BASE_IMAGE=python:3.11-slim
# the extras the image installs (tests/packaging checks them against what compose.yaml runs)
ARG EXTRAS=engine,plot

FROM ${BASE_IMAGE} AS requirements
ARG EXTRAS
WORKDIR /src
COPY pyproject.toml ./
# one a line: what builds the project, its dependencies and those of $EXTRAS
RUN python -c 'import sys, tomllib; t = tomllib.load(open("pyproject.toml", "rb")); p = t["project"]; x = p["optional-dependencies"]; print(*t["build-system"]["requires"], *p["dependencies"], *(d for e in sys.argv[1].split(",") for d in x[e]), sep="\n")' "$EXTRAS" > requirements.txt

FROM ${BASE_IMAGE}
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG EXTRAS
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
# torch pinned and taken from the CPU index (override TORCH_INDEX for a CUDA build)
RUN pip install --index-url "$TORCH_INDEX" torch==2.13.0
COPY --from=requirements /src/requirements.txt /tmp/requirements.txt
RUN pip install -r /tmp/requirements.txt
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
# nothing downloaded here: every dependency is installed above, as pip check confirms
RUN pip install --no-deps --no-build-isolation ".[$EXTRAS]" && pip check
RUN useradd --create-home --uid 1000 kv
USER kv
CMD ["kvctl", "--help"]
