# kvferry engine image for CUDA (p5en.48xlarge): vLLM's own OpenAI-server image plus kvferry.
# Build from the repository root:  docker build -f docker/cuda.Dockerfile -t kvferry-cuda:0.1.0 .
# vLLM 0.26.0 is inside pyproject's cuda extra (vllm>=0.21,<0.34) and is the version kvferry
# ran end to end on GPUs; pip keeps the image's vLLM (the extra's range is already met) and
# adds the extra's pinned NIXL. Never built or pushed by this project (no Docker engine here).
FROM vllm/vllm-openai:v0.26.0

# The engine's container command is `python -m vllm.entrypoints.openai.api_server ...`
# (kvferry launch --target k8s): make sure `python` names the image's interpreter.
RUN command -v python >/dev/null || ln -s "$(command -v python3)" /usr/local/bin/python

COPY pyproject.toml README.md /src/
COPY connectors /src/connectors
COPY router /src/router
COPY neuron /src/neuron
COPY scripts /src/scripts
RUN python3 -m pip install --no-cache-dir "/src[cuda]" \
    && useradd --uid 10001 --create-home --shell /bin/bash kvferry

USER 10001
ENV HOME=/home/kvferry
WORKDIR /home/kvferry
EXPOSE 8100
# Same probe as the Deployment's (engine HTTP port 8100, scripts/engines.py HTTP_PORT).
HEALTHCHECK --interval=30s --timeout=10s --start-period=600s --retries=5 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8100/health', timeout=5)"]
# vLLM's image starts the API server itself; kvferry's engines give their own command line.
ENTRYPOINT []
CMD ["kvferry", "--help"]
