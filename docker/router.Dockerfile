# kvferry router image: the OpenAI-compatible router only (no vLLM, no torch: its import
# graph reaches neither, tests/test_images.py). Build from the repository root:
#   docker build -f docker/router.Dockerfile -t kvferry-router:0.1.0 .
# Never built or pushed by this project (no Docker engine here).
FROM python:3.12-slim-bookworm

COPY pyproject.toml README.md /src/
COPY connectors /src/connectors
COPY router /src/router
COPY neuron /src/neuron
COPY scripts /src/scripts
RUN python -m pip install --no-cache-dir /src \
    && useradd --uid 10001 --create-home --shell /usr/sbin/nologin kvferry

USER 10001
ENV HOME=/home/kvferry
WORKDIR /home/kvferry
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=4 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=5)"]
ENTRYPOINT ["kvferry"]
CMD ["router", "--host", "0.0.0.0", "--port", "8000"]
