"""One request's way through the engines: the flow, the P, D, push and first-token legs,
migration of a broken stream, and the D-local turn."""
