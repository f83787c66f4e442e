"""leapdecode's server on loopback for the server tests: an app on uvicorn in a thread, the tiny-random
server as a module fixture, a bounded wait, and a job's typed events from an ``Engine``
(tests/test_server.py, test_tools.py, test_tenants.py, test_batch.py, test_batch_gate.py, test_task.py,
test_a_star.py, test_contrastive.py, test_look_back.py, test_phi_decoding.py, test_scaling.py,
test_strategies.py, test_superposed.py)."""

from __future__ import annotations

import pytest


def eventually(cond, what: str, timeout: float = 60.0) -> None:
    """Wait until ``cond()`` holds (the bound only keeps a broken server from hanging the test)."""
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def start_server(app):
    """``app`` on uvicorn in a daemon thread on a free loopback port: (server, thread, base URL);
    stop it with ``server.should_exit = True`` and ``thread.join``."""
    import threading

    import uvicorn

    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    eventually(lambda: srv.started or not thread.is_alive(), "the server did not start")
    assert thread.is_alive(), "the server did not start"
    port = srv.servers[0].sockets[0].getsockname()[1]
    return srv, thread, f"http://127.0.0.1:{port}"


def tiny_server(default_method: str = "vanilla", **app_options):
    """A generator for module fixtures: leapdecode's server on ``tiny-random`` (fp32) on loopback,
    yielding ``url`` (ending in ``/v1``), ``model``, ``app``, ``runner`` and ``engine``; stopped
    after the module."""
    from types import SimpleNamespace

    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    import leapdecode
    from leapdecode.server.app import create_app
    from leapdecode.server.config import ServeConfig

    model = leapdecode.load("tiny-random", dtype="fp32")
    app = create_app(model, ServeConfig(default_method=default_method, max_queue=4, request_timeout=60), **app_options)
    srv, thread, url = start_server(app)
    yield SimpleNamespace(url=url + "/v1", model=model, app=app, runner=app.state.runner, engine=app.state.engine)
    srv.should_exit = True
    thread.join(10)


async def collect_job_events(engine, specs) -> list:
    """Submit one ``Job`` of ``specs`` to a server ``Engine`` and gather its typed events up to
    ``Ended`` (60 s per event at most)."""
    import asyncio

    from leapdecode.server.engine import Ended, Job

    job = Job(specs)
    engine.submit(job)
    events = []
    while not events or not isinstance(events[-1], Ended):
        events.append(await asyncio.wait_for(job.events.get(), 60))
    return events
