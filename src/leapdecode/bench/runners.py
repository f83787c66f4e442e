"""Runners: leapdecode's methods and the peer systems behind one interface.

``runner.run(prompt_ids, max_new_tokens, temperature, seed, structure) -> RunOutput``: decode from
the given prompt token ids (under ``structure``, ``compile_constraint``'s keywords, when given) (every runner gets the same ids, so token ids can be compared
with vanilla's) and report the generated ids without the end-of-sequence token, the wall
time of the whole call, the target's forward passes where known, and the peak resident
memory sampled during the call.

Peers:

* ``hf``, ``hf-assisted``, ``hf-pld``: transformers ``generate`` on the same converted
  weights and device (greedy; with ``assistant_model`` = the draft; with
  ``prompt_lookup_num_tokens=10``); under a structure, with a logits processor running the same
  grammar engine (``GrammarLogitsProcessor``: llguidance through ``constraints/grammar.py``), in
  leapdecode's dtype where its weights are floats, and where they are quantized (which
  transformers cannot run) in the dtype a CPU runs fastest (``hf_dtype``: bf16 with AMX or
  AVX512-BF16, else fp32, which an AVX2-only CPU computes natively instead of converting bf16);
* ``llamacpp``, ``llamacpp-pld``: llama-cpp-python on the model's GGUF (quantized weights,
  so its tokens may differ from vanilla's), greedy and with ``LlamaPromptLookupDecoding``;
* ``llama-server``, ``llama-server-draft``, ``llama-server-ngram`` (and ``-ngram-simple``):
  llama.cpp's own server on the model's GGUF, plain, with the registered draft model's GGUF and
  with its n-gram drafter (``bench/llama_server.py`` builds it once per machine).
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..core.cost_model import synchronize
from ..errors import InvalidParameterError, LeapdecodeError

PEER_FAMILIES = {
    "hf": ["hf", "hf-assisted", "hf-pld"],
    "llamacpp": ["llamacpp", "llamacpp-pld"],
    "hf-generate": ["hf"],  # HF's plain generate alone (``hf`` names the whole family)
    # llama.cpp's own server, built from source once per machine (bench/llama_server.py)
    "llama-server": ["llama-server", "llama-server-draft", "llama-server-ngram"],
    "llama-server-plain": ["llama-server"],  # llama.cpp's plain server alone (``make demo``'s peer)
}
EXTRA_PEER_ROWS = ["llama-server-ngram-simple"]  # rows named one by one, in no family
DRAFT_PEERS = ("hf-assisted", "llama-server-draft")  # peer rows that run the draft model
PEER_NAMES = list(dict.fromkeys([*(n for names in PEER_FAMILIES.values() for n in names), *EXTRA_PEER_ROWS]))
PEERS_INSTALL_HINT = (
    "pip install 'leapdecode[peers]' (builds llama.cpp; on x86 CPUs set "
    'CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" first)'
)
PLD_TOKENS = 10  # prompt-lookup draft length of the HF and llama.cpp peers
RSS_INTERVAL_S = 0.005


@dataclass
class RunOutput:
    tokens: list[int]
    wall_s: float
    target_forwards: int | None = None
    text: str = ""
    finish_reason: str = ""
    peak_rss_mb: float | None = None
    peak_gpu_mb: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    constraint_s: float | None = None  # time in the grammar engine (structured runs)

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)


class SkipPeer(Exception):
    """A peer that cannot run here; the message says why (and how to add it)."""


# --------------------------------------------------------------------------- memory
def _rss_reader() -> Callable[[], int] | None:
    """A cheap function giving this process's resident set size in bytes."""
    page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
    try:
        fd = os.open("/proc/self/statm", os.O_RDONLY)

        def read_statm() -> int:
            return int(os.pread(fd, 128, 0).split()[1]) * page

        read_statm()
        return read_statm
    except (OSError, AttributeError, ValueError, IndexError):
        pass
    try:
        import psutil

        proc = psutil.Process()
        return lambda: proc.memory_info().rss
    except ImportError:
        return None


_READ_RSS = _rss_reader()


class PeakMemory:
    """Peak resident set size of this process while the ``with`` block runs.

    A thread samples RSS every ``RSS_INTERVAL_S`` (``/proc/self/statm``, else psutil):
    ``getrusage``'s ``ru_maxrss`` is a high-water mark for the whole process, so it
    cannot tell the runs apart.  Where neither is available, ``ru_maxrss`` is reported.
    The figure is the whole process's (all loaded models included), not the run's
    increment.  On CUDA the peak allocated GPU memory of the run is recorded too."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device
        self.peak_rss_mb: float | None = None
        self.peak_gpu_mb: float | None = None

    def __enter__(self) -> "PeakMemory":
        self._stop = threading.Event()
        self._peak = _READ_RSS() if _READ_RSS else 0
        if _READ_RSS is not None:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def _sample(self) -> None:
        while not self._stop.wait(RSS_INTERVAL_S):
            try:
                self._peak = max(self._peak, _READ_RSS())
            except Exception:  # pragma: no cover - keep the bench running
                return

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if _READ_RSS is not None:
            self._thread.join()
            self._peak = max(self._peak, _READ_RSS())
            self.peak_rss_mb = round(self._peak / 2**20, 1)
        else:
            kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            self.peak_rss_mb = round((kb if sys.platform != "darwin" else kb / 1024) / 1024, 1)
        if self.device is not None and self.device.type == "cuda":
            self.peak_gpu_mb = round(torch.cuda.max_memory_allocated(self.device) / 2**20, 1)


# --------------------------------------------------------------------------- runners
class Runner:
    name = "runner"
    system = "leapdecode"

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")

    def run(self, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0,
            seed: int | None = None, structure: dict | None = None) -> RunOutput:
        with PeakMemory(self.device) as mem:
            synchronize(self.device)
            t0 = time.perf_counter()
            out = self._run(prompt_ids, max_new_tokens, temperature, seed, structure)
            synchronize(self.device)
            out.wall_s = time.perf_counter() - t0
        out.peak_rss_mb, out.peak_gpu_mb = mem.peak_rss_mb, mem.peak_gpu_mb
        return out

    def _run(self, prompt_ids, max_new_tokens, temperature, seed, structure) -> RunOutput:  # pragma: no cover
        raise NotImplementedError

    def mark(self) -> Any:
        """What the runner has learned from earlier requests' text, for ``rewind``; None where it
        cannot be put back (a peer's server)."""
        return None

    def rewind(self, mark: Any) -> None:
        """Forget the text of the requests since ``mark``: a repeat of a request, and the first timed
        run of the warm-up's prompt, never draft from that request's own earlier output."""

    def close(self) -> None:
        pass


def split_method_row(text: str) -> tuple[str, dict]:
    """A bench row ``METHOD`` or ``METHOD:KEY=VALUE:KEY=VALUE`` (e.g. ``pld:cost_aware=false``, a
    method with options, so that two settings of one method compare in one run) -> (method, typed
    options); ``InvalidParameterError`` names an unknown method or a bad option."""
    from ..core.config import parse_option_assignments
    from ..proposers import METHODS, method_config

    base, *pairs = [p.strip() for p in text.split(":")]
    if base not in METHODS:
        raise InvalidParameterError(f"unknown method {base!r}; choose from {', '.join(METHODS)}")
    try:
        opts = parse_option_assignments(METHODS[base].config, pairs)
        method_config(base, opts)
    except InvalidParameterError as e:
        raise InvalidParameterError(f"--methods row {text!r}: {e}") from None
    return base, opts


class LeapdecodeRunner(Runner):
    """One of leapdecode's methods on the loaded target."""

    system = "leapdecode"

    def __init__(self, loaded, method: str, draft: str | None = None, tree_budget: int | None = None,
                 options: dict | None = None, drafts: dict | None = None) -> None:
        """``drafts``: draft models already loaded by other rows (name -> LoadedModel), shared so
        that each draft loads once per bench; this row adds the ones it loads.  A row loads a draft
        only when its method builds one (at its first run: the warm-up), so ``auto`` with a trained
        head, which leaves the registered draft out, never loads it."""
        from ..core.runner import ModelRunner
        from ..proposers import method_config, method_spec

        super().__init__(loaded.device)
        self.loaded, self.name = loaded, method  # the row's label: ``METHOD`` or ``METHOD:KEY=VALUE...``
        if ":" in method:
            method, row_opts = split_method_row(method)
            options = {**row_opts, **(options or {})}
        self.method = method
        opts = dict(options or {})
        fields = method_spec(method).config.option_names()
        if draft is not None and "draft" in fields:
            opts.setdefault("draft", draft)
        if tree_budget is not None:
            opts.setdefault("tree_budget", tree_budget)
        self.config = method_config(method, opts)
        # one runner per bench row: each method learns across the bench's prompts, as in a process
        # that serves one method, without sharing what it learns with the other rows
        self.runner = ModelRunner(loaded, prefix_cache_bytes=0)  # every run prefills its prompt
        self.shared_drafts = drafts if drafts is not None else {}

    def mark(self) -> Any:
        return self.runner.memory.snapshot()

    def rewind(self, mark: Any) -> None:
        self.runner.memory.restore(mark)

    def _run(self, prompt_ids, max_new_tokens, temperature, seed, structure) -> RunOutput:
        from ..api import start_generation

        have = self.runner.drafts
        for name, d in self.shared_drafts.items():  # loaded by another row
            if name not in have:
                self.runner.add_draft(name, d)
        gen = start_generation(self.runner, prompt_ids=list(prompt_ids), max_new_tokens=max_new_tokens,
                               temperature=temperature, seed=seed, method=self.config, **(structure or {}))
        self.shared_drafts.update(self.runner.drafts)  # what this row's method loaded, for the next rows
        res = gen.run()
        return RunOutput(tokens=list(res.tokens), wall_s=0.0, target_forwards=res.stats.get("target_forwards"),
                         text=res.text, finish_reason=res.finish_reason, extra={"stats": res.stats},
                         constraint_s=res.stats.get("constraint_s"))


def _strip_eos(ids: list[int], eos: set[int]) -> tuple[list[int], str]:
    for i, t in enumerate(ids):
        if t in eos:
            return ids[:i], "stop"
    return ids, "length"


def model_files(name_or_path: str):
    """(The HF-format directory of a model argument (registry name, directory, .gguf), the callable
    yielding the GGUF its weights are read from, or None); None for the in-process tiny models."""
    if name_or_path.startswith("tiny-random"):
        return None
    from ..models.loader import model_files as files

    return files(name_or_path)


@contextlib.contextmanager
def _quiet_transformers():
    """No weight-loading progress bars or deprecation chatter inside the bench's progress bar (transformers'
    messages below errors off, as ``convert.quiet_transformers``, and its progress bars and warnings too)."""
    from transformers.utils import logging as hf_logging

    from ..models.convert import quiet_transformers

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with quiet_transformers(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def hf_dtype(loaded) -> torch.dtype:
    """The dtype of the hf-* rows' transformers copy of ``loaded``: its own where its weights are
    floats; for quantized weights the machine's fast one (``dtype="auto"``'s rule), not the bf16 of
    the kernel's activations, which an AVX2-only CPU emulates in transformers' matmuls."""
    from ..models.loader import resolve_dtype

    if loaded.weights in ("int4", "int8"):
        return resolve_dtype("auto", loaded.device)
    return loaded.dtype


class _HFShared:
    """The transformers copy of the target (and draft), loaded once for the hf-* rows."""

    def __init__(self, loaded, draft_arg: str | None) -> None:
        self.loaded = loaded
        self.draft_arg = draft_arg if draft_arg is not None else loaded.draft_name
        self._model = None
        self._assistant = None
        self._grammar_runner = None
        self.forwards = 0

    def constraint(self, structure: dict):
        """A fresh grammar constraint for one generation (llguidance, as leapdecode's own rows)."""
        from ..core.runner import ModelRunner
        from ..constraints.grammar import compile_constraint

        if self._grammar_runner is None:
            self._grammar_runner = ModelRunner(self.loaded, prefix_cache_bytes=0)
        return compile_constraint(self._grammar_runner, **structure)

    def _load(self, path: Path, gguf):
        from transformers import GenerationConfig

        from ..models.hf_backend import transformers_model

        with _quiet_transformers():
            m = transformers_model(path, gguf, hf_dtype(self.loaded))
        # plain defaults: no sampling or penalties a checkpoint's generation_config might carry
        old = m.generation_config
        m.generation_config = GenerationConfig(bos_token_id=old.bos_token_id, eos_token_id=old.eos_token_id,
                                               pad_token_id=old.pad_token_id)
        return m.to(self.loaded.device).eval()

    @property
    def model(self):
        if self._model is None:
            self._model = self._load(self.loaded.path, self.loaded.gguf)

            def count(*_args, **_kwargs):
                self.forwards += 1

            self._model.register_forward_pre_hook(count)
        return self._model

    @property
    def assistant(self):
        if self._assistant is None:
            if self.draft_arg is None:
                raise SkipPeer(f"hf-assisted: {self.loaded.name} has no registered draft; pass --draft NAME")
            files = model_files(self.draft_arg)
            if files is None:
                raise SkipPeer(f"hf-assisted: the draft {self.draft_arg} has no model directory for transformers")
            self._assistant = self._load(*files)
        return self._assistant


class HFRunner(Runner):
    system = "hf"

    def __init__(self, shared: _HFShared, name: str) -> None:
        super().__init__(shared.loaded.device)
        self.shared, self.name = shared, name
        self.eos = set(shared.loaded.eos_token_ids)

    def prepare(self) -> None:
        """Load the weights now (outside the timed runs); SkipPeer when impossible."""
        self.shared.model
        if self.name == "hf-assisted":
            self.shared.assistant

    @torch.inference_mode()
    def _run(self, prompt_ids, max_new_tokens, temperature, seed, structure) -> RunOutput:
        eos = sorted(self.eos)
        # the same end-of-sequence set as leapdecode (chat models end turns with <|im_end|> etc.)
        kwargs: dict[str, Any] = dict(max_new_tokens=max_new_tokens, eos_token_id=eos or None,
                                      pad_token_id=eos[0] if eos else None, do_sample=temperature > 0)
        if temperature > 0:
            kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
            if seed is not None:
                torch.manual_seed(seed)
        if self.name == "hf-assisted":
            kwargs["assistant_model"] = self.shared.assistant
        elif self.name == "hf-pld":
            kwargs["prompt_lookup_num_tokens"] = PLD_TOKENS
        processor = None
        if structure:
            from transformers import LogitsProcessorList

            processor = GrammarLogitsProcessor(self.shared.constraint(structure), len(prompt_ids))
            kwargs["logits_processor"] = LogitsProcessorList([processor])
        model = self.shared.model
        ids = torch.tensor([prompt_ids], device=self.device)
        self.shared.forwards = 0
        with _quiet_transformers():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
        new = out[0, len(prompt_ids):].tolist()
        tokens, finish = _strip_eos(new, self.eos)
        return RunOutput(tokens=tokens, wall_s=0.0, target_forwards=self.shared.forwards, finish_reason=finish,
                         text=self.shared.loaded.tokenizer.decode(tokens, skip_special_tokens=True)
                         if structure else "",
                         constraint_s=processor.seconds if processor is not None else None)


class GrammarLogitsProcessor:
    """A transformers logits processor that masks the scores with the grammar state after the
    tokens generated so far (the same llguidance constraint leapdecode uses).  It follows
    ``input_ids`` wherever they go (assisted generation re-scores candidates and drops rejected
    ones): the constraint is moved to the new tokens by popping to the common prefix."""

    def __init__(self, constraint, prompt_len: int) -> None:
        self.constraint = constraint
        self.prompt_len = prompt_len
        self.pushed: list[int] = []
        self.seconds = 0.0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        c = self.constraint
        new = input_ids[0, self.prompt_len:].tolist()
        common = 0
        while common < min(len(new), len(self.pushed)) and new[common] == self.pushed[common]:
            common += 1
        if len(self.pushed) > common:
            c.pop(len(self.pushed) - common)
            del self.pushed[common:]
        for t in new[common:]:
            if c.is_eos(t) or not c.allows(t):
                break  # a rejected candidate's tail: never scored as a prefix of the output
            c.push(t)
            self.pushed.append(t)
        mask = c.mask().to(scores.device)
        vocab = min(scores.shape[-1], mask.shape[0])
        out = scores.clone()
        out[..., :vocab] = scores[..., :vocab].masked_fill(~mask[:vocab], float("-inf"))
        out[..., vocab:] = float("-inf")
        self.seconds += time.perf_counter() - t0
        return out


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
        tokens, finish = _strip_eos([int(t) for t in out.get("tokens") or []], self.eos)
        timings = out.get("timings") or {}
        extra = {k: timings[k] for k in ("draft_n", "draft_n_accepted") if k in timings}
        return RunOutput(tokens=tokens, wall_s=0.0, target_forwards=forwards_from_timings(timings),
                         finish_reason=finish, extra=extra)

    def close(self) -> None:
        self.server.close()


def _llama_server_peers(names: list[str], loaded, model_arg: str, draft_arg: str | None, n_ctx: int,
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


# --------------------------------------------------------------------------- peers
def expand_peers(spec: list[str]) -> list[str]:
    """``hf`` -> hf, hf-assisted, hf-pld; ``llamacpp`` -> llamacpp, llamacpp-pld;
    ``hf-generate`` -> hf (the plain row alone); row names pass through.  Unknown names raise
    ValueError."""
    out: list[str] = []
    for p in spec:
        p = p.strip().lower().replace("llama.cpp", "llamacpp").replace("llama-cpp", "llamacpp")
        if not p:
            continue
        names = PEER_FAMILIES.get(p, [p] if p in PEER_NAMES else None)
        if names is None:
            raise ValueError(f"unknown peer {p!r}; choose from {', '.join([*PEER_FAMILIES, *PEER_NAMES[1:]])}")
        out.extend(n for n in names if n not in out)
    return out


def gguf_path(model_arg: str, loaded) -> Path | None:
    """The GGUF file behind the model: the ``-m`` argument itself, or a registered model's
    (``registry.assembled_gguf``: multi-part GGUFs are assembled once into the cache).  None
    when unknown."""
    p = Path(model_arg).expanduser()
    if p.suffix == ".gguf" and p.is_file():
        return p
    from ..models import registry

    if model_arg not in registry.REGISTRY:
        return None
    try:
        return registry.assembled_gguf(model_arg)
    except LeapdecodeError:
        return None


def make_peers(names: list[str], loaded, model_arg: str, draft_arg: str | None, n_ctx: int,
               say: Callable[[str], None], build: bool = True) -> list[Runner]:
    """Peer runners for ``names`` (expanded); those that cannot run are skipped with one line each.
    ``build``: build llama.cpp's server now when a llama-server row needs it and none is built."""
    runners: list[Runner] = []
    server_names = [n for n in names if n.startswith("llama-server")]
    if server_names:
        runners += _llama_server_peers(server_names, loaded, model_arg, draft_arg, n_ctx, say, build)
    hf_names = [n for n in names if n.startswith("hf")]
    if hf_names:
        if loaded.path is None:
            say(f"skipping {', '.join(hf_names)}: {loaded.name} has no model directory for transformers "
                "(in-process test model)")
        else:
            shared = _HFShared(loaded, draft_arg)
            for n in hf_names:
                r = HFRunner(shared, n)
                try:
                    r.prepare()
                except SkipPeer as e:
                    say(f"skipping {e}")
                    continue
                except Exception as e:
                    say(f"skipping {n}: transformers could not load the model ({type(e).__name__}: {e})")
                    continue
                runners.append(r)
    cpp_names = [n for n in names if n.startswith("llamacpp")]
    if cpp_names:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            say(f"skipping {', '.join(cpp_names)}: llama-cpp-python is not installed; add it with "
                f"{PEERS_INSTALL_HINT}")
            return runners
        gguf = gguf_path(model_arg, loaded)
        if gguf is None:
            say(f"skipping {', '.join(cpp_names)}: no GGUF file is known for {model_arg}; pass -m FILE.gguf")
            return runners
        for n in cpp_names:
            try:
                runners.append(LlamaCppRunner(gguf, n, n_ctx=n_ctx, eos=set(loaded.eos_token_ids)))
            except Exception as e:
                say(f"skipping {n}: llama.cpp could not load {gguf} ({type(e).__name__}: {e})")
    return runners
