"""The peer systems a bench compares with, by row name: ``hf`` (transformers, ``peers/hf.py``),
``llamacpp`` and ``llama-server`` (llama.cpp, ``peers/llamacpp.py``; its server built once per
machine by ``peers/llama_server.py``).  ``expand_peers`` reads ``--peers``; ``make_peers`` starts
the rows that can run here and names the others.
"""

from __future__ import annotations

from typing import Callable

from ..runners import Runner, SkipPeer
from .hf import HFRunner, HFShared
from .llamacpp import LlamaCppRunner, gguf_path, llama_server_peers

PEER_FAMILIES = {
    "hf": ["hf", "hf-assisted", "hf-pld"],
    "llamacpp": ["llamacpp", "llamacpp-pld"],
    "hf-generate": ["hf"],  # HF's plain generate alone (``hf`` names the whole family)
    # llama.cpp's own server, built from source once per machine (peers/llama_server.py)
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


def make_peers(names: list[str], loaded, model_arg: str, draft_arg: str | None, n_ctx: int,
               say: Callable[[str], None], build: bool = True) -> list[Runner]:
    """Peer runners for ``names`` (expanded); those that cannot run are skipped with one line each.
    ``build``: build llama.cpp's server now when a llama-server row needs it and none is built."""
    runners: list[Runner] = []
    server_names = [n for n in names if n.startswith("llama-server")]
    if server_names:
        runners += llama_server_peers(server_names, loaded, model_arg, draft_arg, n_ctx, say, build)
    hf_names = [n for n in names if n.startswith("hf")]
    if hf_names:
        if loaded.path is None:
            say(f"skipping {', '.join(hf_names)}: {loaded.name} has no model directory for transformers "
                "(in-process test model)")
        else:
            shared = HFShared(loaded, draft_arg)
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
