"""OpenAI-compatible HTTP server: ``leapdecode serve`` (needs the ``server`` extra).

``from leapdecode.server.app import create_app`` builds the FastAPI app;
``server.engine`` holds the single engine thread and its bounded queue.
"""
