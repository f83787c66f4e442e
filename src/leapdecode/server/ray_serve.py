"""``leapdecode serve --ray``: replicas of the same OpenAI-compatible app behind Ray Serve.

Each replica is a Ray actor (its own process) that builds the app exactly as ``leapdecode
serve`` does (``settings.ServeSettings.build_app``: load the model with the same weights, dtype and
attention, ``create_app`` with the same method, drafts, batch, queue and cache sizes, the same
warm-up) and Ray Serve's HTTP proxy routes requests to the replicas, so clients see the same
API on the same paths (``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` with
streaming, ``/health``, ``/metrics``).  Nothing is shared between replicas: each has its own
engine thread, KV caches and prefix cache; ``/health`` and ``/metrics`` answer for the replica
the proxy picked (the ``x-leapdecode-replica`` response header names it).

The deployment uses Ray Serve's documented way to serve an ASGI app built on the replica:
``serve.ingress(builder)`` with a builder function, called when the replica starts (added to Ray
Serve in 2025 by ray-project/ray#52892; hence ``ray[serve]>=2.50``).  Autoscaling bounds are Ray Serve's
``autoscaling_config`` (``min_replicas = initial_replicas = --replicas``, ``max_replicas =
--max-replicas``).  ``run`` starts a local Ray head on loopback (no dashboard, a small object
store) unless given the address of an existing cluster, starts Serve's HTTP proxy on
``--host``/``--port``, deploys, and stays in the foreground until Ctrl-C or SIGTERM; then it
deletes the application (and on a head it started, shuts Serve and Ray down).

Nothing here imports ray at module level: ``require_ray`` says how to install it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import LeapdecodeError

if TYPE_CHECKING:
    from .settings import ServeSettings

APP_NAME = "leapdecode"  # the Serve application (and the prefix of its deployment's name)
DEPLOYMENT_NAME = "LeapdecodeReplica"
REPLICA_HEADER = "x-leapdecode-replica"  # names the replica that answered (Serve's replica id)
LOCAL_HEAD_HOST = "127.0.0.1"
OBJECT_STORE_BYTES = 128 * 2**20  # the local head's object store: requests and answers are small
LOCAL_HEAD_ENV = {
    # Ray's switch for a local-only head (its name says Windows/OSX, where it is the default): the
    # node address stays 127.0.0.1 instead of this machine's outward address
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",  # a loopback head reports to nobody
}


def require_ray() -> None:
    """Raise a ``LeapdecodeError`` naming the extra to install when ray is missing.

    Only looks (``importlib.util.find_spec``): ``run`` imports ray, once its signal handlers are
    in place (a Ctrl-C during that long import must not be lost) and Ray's environment is set."""
    if importlib.util.find_spec("ray") is None:
        raise LeapdecodeError("`serve --ray` needs Ray Serve (ray is missing): pip install 'leapdecode[ray]'")


def import_ray(local_head: bool):
    """``ray`` and ``ray.serve``; ``local_head``: this process starts a local head, so Ray is told,
    before its import (it reads these then), to keep the head's node address on loopback and to
    report no usage statistics (unless the user set these variables)."""
    if local_head:
        for name, value in LOCAL_HEAD_ENV.items():
            os.environ.setdefault(name, value)
    try:
        import ray
        from ray import serve
    except ImportError as e:
        raise LeapdecodeError(f"`serve --ray` needs Ray Serve ({e.name or 'ray'} is missing): "
                              "pip install 'leapdecode[ray]'") from None
    return ray, serve


@dataclass(frozen=True)
class Scale:
    """How many replicas, and what each asks of Ray."""

    replicas: int  # started at once and never fewer (Serve's min_replicas and initial_replicas)
    max_replicas: int  # Serve's autoscaler may add replicas up to this many
    replica_cpus: float  # Ray's logical CPUs reserved per replica (scheduling only)
    threads: int  # torch threads per replica (what it really uses)

    def autoscaling_config(self, max_batch: int) -> dict[str, Any]:
        # a replica counts as busy when it has a full batch in flight: beyond that, scale up
        return {"min_replicas": self.replicas, "initial_replicas": self.replicas,
                "max_replicas": self.max_replicas, "target_ongoing_requests": max_batch}


class ReplicaHeader:
    """ASGI middleware adding ``x-leapdecode-replica: <id>`` to every HTTP response (streams too)."""

    def __init__(self, app, replica: str) -> None:
        self.app, self.value = app, replica.encode("latin-1", "replace")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_header(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (REPLICA_HEADER.encode(), self.value)]}
            await send(message)

        await self.app(scope, receive, send_with_header)


def replica_id() -> str:
    """Serve's id of the replica this runs in (``host:pid`` outside one)."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_tag
    except Exception:
        return f"{socket.gethostname()}:{os.getpid()}"


def build_replica_app(settings: "ServeSettings"):
    """What each replica runs at start-up (in its own process): the same app as ``leapdecode serve``."""
    app = settings.build_app()
    app.add_middleware(ReplicaHeader, replica=replica_id())
    return app


def deployment(settings: "ServeSettings", scale: Scale):
    """The bound Serve application: one deployment whose replicas each build the app."""
    from ray import serve

    max_batch, max_queue = settings.config.max_batch, settings.config.max_queue

    def build():  # a closure: cloudpickle ships ``settings`` with it to every replica
        return build_replica_app(settings)

    options: dict[str, Any] = dict(
        name=DEPLOYMENT_NAME,
        autoscaling_config=scale.autoscaling_config(max_batch),
        ray_actor_options={"num_cpus": scale.replica_cpus},
        # a replica is given no more requests than its batch holds: the rest wait in the proxy,
        # which hands each to the first replica with a free place (a burst sent to one replica's
        # own queue would wait there while another replica idles); at most --max-queue waiting
        # per replica that may exist, then they are refused
        max_ongoing_requests=max_batch,
        max_queued_requests=max_queue * scale.max_replicas,
    )
    try:  # Ray Serve >= 2.5x: refuse those with 429 + Retry-After, as one server does, not 503
        from ray.serve.config import BackpressureConfig

        options["backpressure_config"] = BackpressureConfig(status_code=429, retry_after_s=1)
    except ImportError:
        pass
    return serve.deployment(serve.ingress(build)(), **options).bind()


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def serve_http_address() -> tuple[str, int] | None:
    """The host and port Serve's proxies listen on (None where this Ray version does not say).

    Serve's HTTP options are the cluster's: a Serve already running keeps its own."""
    try:
        from ray.serve.context import _get_global_client  # no public API gives them

        cfg = _get_global_client().http_config
        return str(cfg.host), int(cfg.port)
    except Exception:
        return None


def _log(msg: str) -> None:
    print(f"leapdecode: {msg}", file=sys.stderr, flush=True)


def run(settings: "ServeSettings", scale: Scale, *, address: str | None, host: str, port: int,
        log_level: str = "info") -> int:
    """Serve ``settings``' app on Ray Serve until Ctrl-C or SIGTERM; returns the exit status.

    ``address``: an existing cluster (``"auto"``, ``"HOST:PORT"``, ``"ray://..."``), or None to
    start a local head on loopback (and stop it at the end)."""
    stop = threading.Event()

    def on_signal(signum, frame):  # Ctrl-C or SIGTERM: everything started is undone
        stop.set()
        # Python drops an exception raised where it ignores them (an at-fork hook while Ray spawns
        # its processes; a bare except in some import): ``stop`` stays set, and is checked
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _run(settings, scale, stop, on_signal, address=address, host=host, port=port, log_level=log_level)
    except KeyboardInterrupt:  # before Ray started, or a second Ctrl-C while shutting down
        _log("interrupted")
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run(settings, scale: Scale, stop: threading.Event, on_signal, *, address, host, port, log_level) -> int:
    def check() -> None:
        if stop.is_set():
            raise KeyboardInterrupt

    model_name = settings.config.served_model_name or settings.model
    local = address is None
    ray, serve = import_ray(local_head=local)
    check()
    level = getattr(logging, log_level.upper(), logging.INFO)
    ray_level = max(level, logging.WARNING)
    stage, deploying = "starting", False
    try:
        if local:
            cpus = os.cpu_count() or 1
            stage = f"starting a local Ray head on {LOCAL_HEAD_HOST}"
            _log(f"{stage} ({cpus} CPUs, no dashboard)")
            ray.init(address="local", num_cpus=cpus, include_dashboard=False, _node_ip_address=LOCAL_HEAD_HOST,
                     object_store_memory=OBJECT_STORE_BYTES, logging_level=ray_level)
            if scale.max_replicas * scale.replica_cpus > cpus:
                _log(f"warning: {scale.max_replicas} replicas x {scale.replica_cpus:g} CPUs exceed this head's "
                     f"{cpus} CPUs: Ray cannot place them all (lower --replica-cpus)")
        else:
            stage = f"connecting to the Ray cluster at {address}"
            _log(stage)
            ray.init(address=address, logging_level=ray_level)
        signal.signal(signal.SIGTERM, on_signal)  # ray.init installed its own
        check()
        serve_logging = {"log_level": log_level.upper(), "enable_access_log": level <= logging.INFO}
        stage = f"starting Serve's HTTP proxy on {host}:{port}"
        serve.start(http_options={"host": host, "port": port}, logging_config=serve_logging)
        check()
        running = serve_http_address()
        if running is not None and running != (host, port):  # Serve was already running on the cluster
            _log(f"warning: Serve already runs on this cluster with its HTTP proxies on {running[0]}:{running[1]}; "
                 f"--host/--port are not applied (`serve shutdown` first to change them)")
            host, port = running
        stage = f"deploying {model_name}"
        _log(f"deploying {scale.replicas} replica(s) of {model_name} (at most {scale.max_replicas}; "
             f"{scale.threads} torch thread(s) and {scale.replica_cpus:g} Ray CPU(s) each)")
        deploying = True
        serve.run(deployment(settings, scale), name=APP_NAME, route_prefix="/",
                  blocking=False, logging_config=serve_logging)
        check()
        _log(f"serving {model_name} on http://{host}:{port}/v1 through Ray Serve "
             f"({scale.replicas}..{scale.max_replicas} replicas); Ctrl-C stops")
        while not stop.wait(1.0):  # the signal handler raises KeyboardInterrupt here
            pass
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        _log("shutting down")
    except (RuntimeError, ConnectionError, ValueError) as e:  # e.g. a replica could not build the app
        raise LeapdecodeError(f"Ray Serve failed while {stage}: {e}") from None
    finally:
        # shutting down: another SIGTERM waits for it, another Ctrl-C aborts it
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if ray.is_initialized():  # (serve's calls would start a Ray instance otherwise)
            try:
                if local:
                    serve.shutdown()
                elif deploying:
                    serve.delete(APP_NAME)  # leave the cluster's Serve (and other applications) running
            finally:
                ray.shutdown()
    return 0
