"""The router's HTTP surface: the FastAPI app, admission, auth, body intake and workers."""
