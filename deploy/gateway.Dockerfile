# The gateway image: the OpenAI-compatible HTTP front (`specdec-gateway`), a gRPC client of the executors; no torch,
# no model (`pip install .[gateway-fast]`: the gateway with uvloop and httptools).
#   docker build -f deploy/gateway.Dockerfile -t specdec-gateway .
# docker-compose.yml builds it this way; the server reads every flag from SPECDEC_<FLAG> (--executor: SPECDEC_EXECUTOR).

ARG PYTHON_IMAGE=python:3.12-slim-bookworm

# --- builder: build the project's wheel, install it with its dependencies into a virtual environment ---------
FROM ${PYTHON_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY protos/specdec protos/specdec
COPY specdec_runtime specdec_runtime
COPY selection selection
COPY selector_service selector_service
COPY executor_service executor_service
COPY kernels kernels
COPY specdec_cli specdec_cli
COPY gateway_service gateway_service
COPY specdec_training specdec_training
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip wheel --no-deps --wheel-dir /dist . \
 && /opt/venv/bin/pip install "$(ls /dist/specdec-*.whl)[gateway-fast]"

# --- runtime: the virtual environment, run as an unprivileged user -------------------------------------------
FROM ${PYTHON_IMAGE}
COPY --from=builder /opt/venv /opt/venv
RUN useradd --system --uid 10001 --create-home --home-dir /home/specdec specdec
USER specdec
WORKDIR /home/specdec
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 SPECDEC_HOST=0.0.0.0 SPECDEC_PORT=8000
EXPOSE 8000
# /metrics answers whenever the gateway serves HTTP; /health follows the executors (a readiness signal, not liveness).
HEALTHCHECK --interval=10s --timeout=5s --start-period=10s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/metrics', timeout=4)"]
ENTRYPOINT ["specdec-gateway"]
