"""llama.cpp as a peer: ``llamacpp`` and ``llamacpp-pld`` (llama-cpp-python on the model's GGUF,
quantized weights, so its tokens may differ from vanilla's; greedy and with
``LlamaPromptLookupDecoding``), and llama.cpp's own server (``llama-server``, ``llama-server-draft``,
``llama-server-ngram``, ``-ngram-simple``: plain, with the registered draft model's GGUF and with its
n-gram drafter; ``peers/llama_server.py`` builds it once per machine and runs it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import torch

from ...errors import LeapdecodeError
from ..runners import PLD_TOKENS, Runner, RunOutput, SkipPeer, strip_eos


class LlamaCppRunner(Runner):
    system = "llama.cpp"

    def __init__(self, gguf: Path, name: str, n_ctx: int, eos: set[int]) -> None:
        super().__init__(torch.device("cpu"))
        from llama_cpp import Llama  # guarded by the caller

        kwargs: dict[str, Any] = {}
        if name == "llamacpp-pld":
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            kwargs["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=PLD_TOKENS)
        self.name = name
        self.eos = set(eos)
        self.llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=os.cpu_count() or 1,
                         n_gpu_layers=-1 if torch.cuda.is_available() else 0, verbose=False,
                         seed=0, **kwargs)
        self.eos.add(int(self.llm.token_eos()))

    def _run(self, prompt_ids, max_new_tokens, temperature, seed, structure) -> RunOutput:
        if structure:
            raise SkipPeer(f"{self.name}: structured output is not benchmarked on llama.cpp here")
        self.llm.reset()
        if seed is not None and hasattr(self.llm, "set_seed"):
            self.llm.set_seed(seed)
        tokens: list[int] = []
        finish = "length"
        sampling = dict(temp=temperature, top_k=1 if temperature <= 0 else 0, top_p=1.0, min_p=0.0,
                        repeat_penalty=1.0)
        for t in self.llm.generate(list(prompt_ids), reset=True, **sampling):
            if t in self.eos:
                finish = "stop"
                break
            tokens.append(int(t))
            if len(tokens) >= max_new_tokens:
                break
        return RunOutput(tokens=tokens, wall_s=0.0, target_forwards=None, finish_reason=finish)

    def close(self) -> None:
        try:
            self.llm.close()
        except Exception:
            pass


class LlamaServerRunner(Runner):
    """One configuration of llama.cpp's server (``llama_server.CONFIGS``), started for the bench."""

    system = "llama.cpp"

    def __init__(self, name: str, binary: Path, gguf: Path, n_ctx: int, eos: set[int],
                 draft_gguf: Path | None = None) -> None:
        from .llama_server import LlamaServer, free_port, server_command

        super().__init__(torch.device("cpu"))
        self.name, self.eos = name, set(eos)
        port = free_port()
        threads = torch.get_num_threads()  # the threads leapdecode's rows use
        self.server = LlamaServer(server_command(binary, name, gguf, n_ctx, threads, port, draft_gguf), port)

    def _run(self, prompt_ids, max_new_tokens, temperature, seed, structure) -> RunOutput:
        from .llama_server import forwards_from_timings

        if structure:
            raise SkipPeer(f"{self.name}: structured output is not benchmarked on llama.cpp here")
        out = self.server.complete(prompt_ids, max_new_tokens, temperature, seed)
        tokens, finish = strip_eos([int(t) for t in out.get("tokens") or []], self.eos)
        timings = out.get("timings") or {}
        extra = {k: timings[k] for k in ("draft_n", "draft_n_accepted") if k in timings}
        return RunOutput(tokens=tokens, wall_s=0.0, target_forwards=forwards_from_timings(timings),
                         finish_reason=finish, extra=extra)

    def close(self) -> None:
        self.server.close()


def llama_server_peers(names: list[str], loaded, model_arg: str, draft_arg: str | None, n_ctx: int,
                        say: Callable[[str], None], build: bool) -> list[Runner]:
    """The llama-server rows: the cached build (built now when ``build``), one server each."""
    from .llama_server import ServerUnavailable, build_server, server_binary

    try:
        binary = server_binary()
        if binary is None and build:
            binary = build_server(say)
    except ServerUnavailable as e:
        say(f"skipping {', '.join(names)}: {e}")
        return []
    if binary is None:
        say(f"skipping {', '.join(names)}: llama.cpp's server is not built on this machine "
            "(`leapdecode bench --peers llama-server` builds it once)")
        return []
    gguf = gguf_path(model_arg, loaded)
    if gguf is None:
        say(f"skipping {', '.join(names)}: no GGUF file is known for {model_arg}; pass -m FILE.gguf")
        return []
    draft_name = draft_arg if draft_arg is not None else loaded.draft_name
    draft_gguf = gguf_path(draft_name, None) if draft_name else None
    runners: list[Runner] = []
    for n in names:
        try:
            runners.append(LlamaServerRunner(n, binary, gguf, n_ctx=n_ctx, eos=set(loaded.eos_token_ids),
                                             draft_gguf=draft_gguf))
        except ServerUnavailable as e:
            say(f"skipping {n}: {e}")
    return runners


def gguf_path(model_arg: str, loaded) -> Path | None:
    """The GGUF file behind the model: the ``-m`` argument itself, or a registered model's
    (``registry.assembled_gguf``: multi-part GGUFs are assembled once into the cache).  None
    when unknown."""
    p = Path(model_arg).expanduser()
    if p.suffix == ".gguf" and p.is_file():
        return p
    from ...models import registry

    if model_arg not in registry.REGISTRY:
        return None
    try:
        return registry.assembled_gguf(model_arg)
    except LeapdecodeError:
        return None
