"""``leapdecode serve``: the OpenAI-compatible HTTP server (FastAPI + uvicorn)."""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import sys

from ..errors import LeapdecodeError
from .config import ServeConfig
from .settings import ServeSettings


def add_parser(subparsers) -> None:
    from ..cli_args import add_model_args
    from ..proposers import DEFAULT_METHOD, METHODS
    from . import MEMORY_SCOPES

    p = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve one model over an OpenAI-compatible API: /v1/models, /v1/completions, "
                    "/v1/chat/completions (streaming with stream: true), /health and /metrics (Prometheus). "
                    "Requests are decoded together (continuous batching) on one engine thread behind a bounded "
                    "queue. With --ray, several replicas of this server run behind Ray Serve (docs/ray.md).")
    add_model_args(p)
    p.add_argument("--draft", action="append", metavar="NAME",
                   help="draft model to load at start-up (repeatable; the first is the default of methods that "
                        "take a draft, except the model's registered draft, which they find by themselves: auto "
                        "then leaves it out beside a trained head); requests may use only these (default: the "
                        "model's registered draft when the default method uses one)")
    p.add_argument("--datastore", action="append", metavar="NAME=PATH",
                   help="a retrieval datastore requests may name (repeatable; `rest`'s datastore option takes "
                        "NAME: the server opens no path a request names)")
    p.add_argument("--head", action="append", metavar="NAME=PATH",
                   help="a trained head directory requests may name (repeatable; the head option of medusa, "
                        "hydra and eagle takes NAME; without it they use the store's head for the model)")
    p.add_argument("--method", default=DEFAULT_METHOD,
                   help=f"default decoding method: {', '.join(METHODS)} (default: %(default)s); a request may "
                        "choose another with \"leapdecode\": {\"method\": ...}")
    p.add_argument("--option", action="append", metavar="KEY=VALUE",
                   help="an option of the default method (repeatable; see `leapdecode methods`)")
    p.add_argument("--tree-budget", type=int, help="default max drafted tokens verified per step")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port (default: %(default)s; 0 picks a free one)")
    p.add_argument("--api-key", action="append", metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1 endpoints and /metrics (repeatable: each key "
                        "is a tenant, whose cross-request memory is its own; default: $LEAPDECODE_API_KEY)")
    p.add_argument("--memory-scope", choices=MEMORY_SCOPES, default=ServeConfig.memory_scope,
                   help="whose cross-request memory (suffix's tries, learned statistics, the prefix cache) a "
                        "request reads and feeds: key (its API key's; the default), user (its key's and its "
                        "`user` field's: the operator trusts the field), or shared (every client's: one client's "
                        "text then steers the drafts and timing others see; docs/server.md)")
    p.add_argument("--memory-budget-mib", type=int, default=ServeConfig.memory_budget_bytes >> 20,
                   help="MiB the cross-request memory may hold, every tenant's together; past it the least "
                        "recently used goes (0 = no budget; default: %(default)s)")
    p.add_argument("--request-limit", action="append", metavar="METHOD.OPTION=N",
                   help="raise or lower the most a request may ask of an option that sizes shared state or a "
                        "step's work (repeatable; e.g. suffix.depth=128, suffix.remember_prompts=true, "
                        "tree_budget=32 for every method); a request above it gets 400 naming it. `leapdecode "
                        "methods` shows each bounded option's default bound")
    p.add_argument("--max-grammar-bytes", type=int, default=ServeConfig.max_grammar_bytes,
                   help="largest structured-output request: its JSON schemas (response_format, tools' "
                        "parameters), regex or grammar together, in bytes of JSON; more gets 400 "
                        "(default: %(default)s)")
    p.add_argument("--grammar-timeout", type=float, default=ServeConfig.grammar_timeout,
                   help="seconds a request's schema check (in a child process) and its grammar's compilation may "
                        "each take; past it the request gets 400 (default: %(default)s)")
    p.add_argument("--metrics-public", action="store_true",
                   help="serve /metrics without the API key (default: it needs the key when one is set)")
    p.add_argument("--max-queue", type=int, default=ServeConfig.max_queue,
                   help="requests that may wait for a place in the batch; more get 429 with Retry-After "
                        "(default: %(default)s)")
    p.add_argument("--max-batch", type=int, default=ServeConfig.max_batch,
                   help="generations decoded together in one batched forward (continuous batching; "
                        "default: %(default)s; 1 = one at a time)")
    p.add_argument("--kv-budget-mib", type=int, default=4096,
                   help="MiB of KV cache the running generations may reserve; a request waits until its "
                        "slot fits, one that never can gets 400 (default: %(default)s)")
    p.add_argument("--prefix-cache-mib", type=int, default=512,
                   help="MiB of prompt KV kept for reuse by requests that start alike (exact; 0 = off; "
                        "default: %(default)s)")
    p.add_argument("--no-speculation-under-load", action="store_true",
                   help="keep every greedy request's full draft tree however full the batch is (default: "
                        "trees shrink as the batch fills, where the measured cost says they stop paying)")
    p.add_argument("--request-timeout", type=float, default=ServeConfig.request_timeout,
                   help="seconds (queueing included) after which a request's generation is cancelled "
                        "(default: %(default)s)")
    p.add_argument("--max-tokens-limit", type=int,
                   help="largest max_tokens a request may ask for (default: the model's context length)")
    p.add_argument("--default-max-tokens", type=int, default=ServeConfig.default_max_tokens,
                   help="max_tokens of chat requests that give none (default: %(default)s; completions: 16)")
    p.add_argument("--max-body-bytes", type=int, default=ServeConfig.max_body_bytes,
                   help="largest request body accepted; larger ones get 413 (default: %(default)s)")
    p.add_argument("--served-model-name", help="the model id clients use (default: the model's name)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--no-warmup", action="store_true", help="skip the one-token warm-up generation at start")
    p.add_argument("--threads", type=int,
                   help="torch threads (per replica with --ray; default: torch's own choice, with --ray this "
                        "machine's cores // --max-replicas, at least 1)")
    r = p.add_argument_group(
        "scale-out on Ray Serve (needs the ray extra: pip install 'leapdecode[ray]'; see docs/ray.md)",
        "With --ray, replicas of the same server run as Ray Serve replicas (each its own process, model, "
        "KV caches and prefix cache) behind Ray Serve's HTTP proxy on --host/--port: same API, same paths. "
        "Every other option applies to each replica.")
    r.add_argument("--ray", action="store_true",
                   help="serve through Ray Serve: a local Ray head on 127.0.0.1 (no dashboard), or the cluster "
                        "at --ray-address; stays in the foreground until Ctrl-C, then shuts Serve down")
    r.add_argument("--replicas", type=int,
                   help="replicas started at once, and the fewest the autoscaler keeps (default: 1)")
    r.add_argument("--max-replicas", type=int,
                   help="the most replicas Ray Serve's autoscaler may run when every replica has a full batch "
                        "in flight (default: --replicas, i.e. a fixed number)")
    r.add_argument("--ray-address",
                   help="an existing Ray cluster to deploy on: auto (the cluster `ray start` made on this "
                        "machine), HOST:PORT of its head, or ray://HOST:10001 (default: start a local head)")
    r.add_argument("--replica-cpus", type=float,
                   help="Ray logical CPUs each replica reserves (scheduling only; fractions allowed; "
                        "default: --threads)")
    p.set_defaults(func=cmd_serve)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_ray_args(a: argparse.Namespace) -> None:
    """The Ray options: only with --ray, and in range (defaults filled in here)."""
    if not a.ray:
        for flag, v in (("--replicas", a.replicas), ("--max-replicas", a.max_replicas),
                        ("--ray-address", a.ray_address), ("--replica-cpus", a.replica_cpus)):
            if v is not None:
                raise LeapdecodeError(f"{flag} needs --ray")
        return
    a.replicas = 1 if a.replicas is None else a.replicas
    if a.replicas < 1:
        raise LeapdecodeError(f"--replicas must be >= 1, got {a.replicas}")
    a.max_replicas = a.replicas if a.max_replicas is None else a.max_replicas
    if a.max_replicas < a.replicas:
        raise LeapdecodeError(f"--max-replicas ({a.max_replicas}) must be >= --replicas ({a.replicas})")
    if a.ray_address is not None and not a.ray_address.strip():
        raise LeapdecodeError("--ray-address must not be empty (use auto for the cluster on this machine)")
    if a.threads is None:
        a.threads = max(1, (os.cpu_count() or 1) // a.max_replicas)
    if a.replica_cpus is None:
        a.replica_cpus = float(a.threads)
    if not a.replica_cpus > 0:
        raise LeapdecodeError(f"--replica-cpus must be > 0, got {a.replica_cpus:g}")
    if a.port == 0 and a.ray_address is not None:
        raise LeapdecodeError("--port 0 (a free port) needs the local Ray head: give a port with --ray-address")


def named_paths(flag: str, values: list[str] | None) -> dict[str, str]:
    """``NAME=PATH`` arguments of ``flag`` as {name: absolute path}; a missing path, a repeated name
    or another form is a start-up error."""
    out: dict[str, str] = {}
    for v in values or []:
        name, sep, path = v.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise LeapdecodeError(f"{flag} takes NAME=PATH, got {v!r}")
        if name in out:
            raise LeapdecodeError(f"{flag}: the name {name!r} is given twice")
        full = os.path.abspath(os.path.expanduser(path))
        if not os.path.exists(full):
            raise LeapdecodeError(f"{flag} {name}: {full} does not exist")
        out[name] = full
    return out


def cmd_serve(a: argparse.Namespace) -> int:
    from ..cli_args import LoadOptions
    from ..core.config import parse_option_assignments
    from ..proposers import method_config, method_spec
    from ..proposers.registry import parse_request_limits

    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise LeapdecodeError(f"`serve` needs the server extra ({e.name} is missing): "
                              "pip install 'leapdecode[server]'") from None
    spec = method_spec(a.method)
    options = parse_option_assignments(spec.config, a.option)
    for name, v, lo in (("--max-queue", a.max_queue, 1), ("--default-max-tokens", a.default_max_tokens, 1),
                        ("--max-tokens-limit", a.max_tokens_limit, 1), ("--tree-budget", a.tree_budget, 1),
                        ("--max-body-bytes", a.max_body_bytes, 1), ("--max-batch", a.max_batch, 1),
                        ("--kv-budget-mib", a.kv_budget_mib, 1), ("--prefix-cache-mib", a.prefix_cache_mib, 0),
                        ("--max-grammar-bytes", a.max_grammar_bytes, 1)):
        if v is not None and v < lo:
            raise LeapdecodeError(f"{name} must be >= {lo}, got {v}")
    method_config(a.method, {**({"tree_budget": a.tree_budget} if a.tree_budget else {}), **options})
    for flag, seconds in (("--request-timeout", a.request_timeout), ("--grammar-timeout", a.grammar_timeout)):
        if not (math.isfinite(seconds) and seconds > 0):
            raise LeapdecodeError(f"{flag} must be a number of seconds > 0, got {seconds}")
    if a.api_key is None and os.environ.get("LEAPDECODE_API_KEY") is not None:
        a.api_key = [os.environ["LEAPDECODE_API_KEY"]]
    for key in a.api_key or []:
        if not key.strip() or key != key.strip():
            # an unset variable (--api-key "$KEY") would serve without authentication; a blank or padded
            # key could never be sent back (clients strip the header's value)
            raise LeapdecodeError("--api-key (or $LEAPDECODE_API_KEY) is empty or has leading or trailing spaces: "
                                  "give the key itself, or leave both out to serve without authentication")
    if len(set(a.api_key or [])) != len(a.api_key or []):
        raise LeapdecodeError("--api-key: a key is given twice (each key is a tenant of its own)")
    if a.memory_budget_mib < 0:
        raise LeapdecodeError(f"--memory-budget-mib must be >= 0, got {a.memory_budget_mib}")
    limits = parse_request_limits(a.request_limit)
    if not 0 <= a.port <= 65535:
        raise LeapdecodeError(f"--port must be in 0..65535, got {a.port}")
    if a.threads is not None and a.threads < 1:
        raise LeapdecodeError(f"--threads must be >= 1, got {a.threads}")
    check_ray_args(a)
    files = {flag: named_paths(flag, getattr(a, flag.strip("-"))) for flag in ("--datastore", "--head")}
    if a.ray:
        from . import ray_serve

        ray_serve.require_ray()  # before anything starts

    config = ServeConfig(
        default_method=a.method, default_options=options, tree_budget=a.tree_budget,
        drafts=None if a.draft is None else tuple(a.draft), datastores=files["--datastore"],
        heads=files["--head"], request_limits=limits, max_tokens_limit=a.max_tokens_limit,
        default_max_tokens=a.default_max_tokens, served_model_name=a.served_model_name, api_keys=tuple(a.api_key or ()),
        memory_scope=a.memory_scope, memory_budget_bytes=(a.memory_budget_mib << 20) or None,
        metrics_public=a.metrics_public, max_batch=a.max_batch, max_queue=a.max_queue,
        kv_budget_bytes=a.kv_budget_mib * 2**20, speculate_under_load=not a.no_speculation_under_load,
        prefix_cache_bytes=a.prefix_cache_mib * 2**20, request_timeout=a.request_timeout,
        max_body_bytes=a.max_body_bytes, max_grammar_bytes=a.max_grammar_bytes, grammar_timeout=a.grammar_timeout)
    settings = ServeSettings(
        model=a.model, load=LoadOptions.from_args(a), config=config, warmup=not a.no_warmup, threads=a.threads)
    if not _is_loopback(a.host) and not a.api_key:
        print(f"leapdecode: warning: serving on {a.host} without --api-key: anyone who can reach this "
              "address can use the model", file=sys.stderr)
    if a.ray:
        port = a.port or ray_serve.free_port(a.host)
        scale = ray_serve.Scale(replicas=a.replicas, max_replicas=a.max_replicas, replica_cpus=a.replica_cpus,
                                threads=a.threads)
        return ray_serve.run(settings, scale, address=a.ray_address, host=a.host, port=port, log_level=a.log_level)

    app = settings.build_app()
    model = app.state.model
    drafts = ", ".join(app.state.runner.drafts) or "none"
    print(f"leapdecode: serving {app.state.config.model_name} ({model.backend}, {model.device}, "
          f"method {a.method}, drafts: {drafts}) on http://{a.host}:{a.port}/v1", file=sys.stderr, flush=True)
    uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level, timeout_graceful_shutdown=5)
    return 0
