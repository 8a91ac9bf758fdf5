"""Which container image each role of a k8s fleet runs: the router's slim image, and the
engines' CUDA or Neuron image by instance type, each built from its Dockerfile in docker/
(never built or pushed by this project: no Docker engine where it is developed).

Containers name a placeholder per role; kustomization.yaml maps each to the real image, so
`kustomize edit set image kvferry-engine=...` retargets a fleet without regenerating it.
"""

from __future__ import annotations

from .instances import INSTANCES

VERSION = "0.1.0"  # pyproject's project.version: the tag `docker build` is told to use
DOCKERFILES: dict[str, str] = {
    "cuda": "docker/cuda.Dockerfile",
    "neuron": "docker/neuron.Dockerfile",
    "router": "docker/router.Dockerfile",
}
ENGINE_PLACEHOLDER = "kvferry-engine"
ROUTER_PLACEHOLDER = "kvferry-router"


def default_image(kind: str) -> str:
    """``kvferry-<kind>:<version>``: the tag docker/<kind>.Dockerfile's header builds."""
    return f"kvferry-{kind}:{VERSION}"


def engine_kind(instance_type: str) -> str:
    """cuda (p5en) or neuron (trn2): the engine image an instance type needs."""
    return INSTANCES[instance_type].backend


def role_images(instance_type: str, engine: str | None, router: str | None) -> dict[str, str]:
    """Placeholder -> image: the engine image by hardware unless given, likewise the router."""
    return {ENGINE_PLACEHOLDER: engine or default_image(engine_kind(instance_type)),
            ROUTER_PLACEHOLDER: router or default_image("router")}
