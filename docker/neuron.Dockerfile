# kvferry engine image for Neuron (trn2.48xlarge): AWS's vLLM Neuron deep-learning container
# plus kvferry. Build from the repository root:
#   docker build -f docker/neuron.Dockerfile -t kvferry-neuron:0.1.0 .
# Base: AWS Neuron SDK 2.31 "PyTorch Inference vLLM (NeuronX)" DLC, vLLM 0.21.0 with
# vllm-neuron 0.21.0.1.0.0 (the SDK and vLLM kvferry's Neuron path targets). Name and tag
# as given by AWS: Neuron docs "Quickstart: Configure and deploy a vLLM server using Neuron
# Deep Learning Container (DLC)" (awsdocs-neuron.readthedocs-hosted.com/en/v2.31.1/deploy/
# environments/quickstart-deploy-dlc.html) and the image list it links
# (github.com/aws-neuron/deep-learning-containers#vllm-inference-neuronx).
# The DLC brings vLLM, vllm-neuron and the Neuron runtime; kvferry adds its neuron extra
# (the pinned NIXL). Never built or pushed by this project (no Docker engine here).
FROM public.ecr.aws/neuron/pytorch-inference-vllm-neuronx:0.21.0.1.0.0-neuronx-py313-sdk2.31.0-ubuntu24.04

RUN command -v python >/dev/null || ln -s "$(command -v python3)" /usr/local/bin/python

COPY pyproject.toml README.md /src/
COPY connectors /src/connectors
COPY router /src/router
COPY neuron /src/neuron
COPY scripts /src/scripts
RUN python3 -m pip install --no-cache-dir "/src[neuron]" \
    && useradd --uid 10001 --create-home --shell /bin/bash kvferry

USER 10001
ENV HOME=/home/kvferry
WORKDIR /home/kvferry
EXPOSE 8100
HEALTHCHECK --interval=30s --timeout=10s --start-period=3600s --retries=5 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8100/health', timeout=5)"]
ENTRYPOINT []
CMD ["kvferry", "--help"]
