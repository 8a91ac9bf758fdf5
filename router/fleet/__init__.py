"""The engines the router sends to: pools of upstreams, discovery and health, their limits
and the prefill engines' KV events."""
