"""The OpenAI-compatible API over an ``AsyncClient``: request schema, FastAPI app and server."""
