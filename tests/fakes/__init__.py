"""FAKES for hardware this CPU CI lacks (Neuron runtime, vllm-neuron platform). Test-only."""
