# The selector image: the BackendSelector gRPC server, CPU only, no torch (`pip install .[selector]`).
#   docker build -f deploy/selector.Dockerfile -t specdec-selector .
# docker-compose.yml builds it this way; the server reads every flag from SPECDEC_<FLAG> (--port: SPECDEC_PORT).

ARG PYTHON_IMAGE=python:3.12-slim-bookworm

# --- builder: build the project's wheel, install it with its dependencies into a virtual environment ---------
FROM ${PYTHON_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# Only what the wheel is built from (the generated gRPC stubs are committed under protos/specdec).
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
 && /opt/venv/bin/pip install "$(ls /dist/specdec-*.whl)[selector]"

# --- runtime: the virtual environment and the health probe, run as an unprivileged user ----------------------
FROM ${PYTHON_IMAGE}
COPY --from=builder /opt/venv /opt/venv
COPY deploy/healthcheck.py /opt/specdec/healthcheck.py
RUN useradd --system --uid 10001 --create-home --home-dir /home/specdec specdec
USER specdec
WORKDIR /home/specdec
# The image's python is the venv's, so `python /opt/specdec/healthcheck.py` (the compose health check) works.
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 SPECDEC_HOST=0.0.0.0 SPECDEC_PORT=50051
EXPOSE 50051
HEALTHCHECK --interval=10s --timeout=5s --start-period=10s --retries=3 CMD ["python", "/opt/specdec/healthcheck.py"]
ENTRYPOINT ["specdec-selector"]
