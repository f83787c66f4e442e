"""The ``hf``, ``hf-assisted`` and ``hf-pld`` peers: transformers ``generate`` on the same converted
weights and device (greedy; with ``assistant_model`` = the draft; with ``prompt_lookup_num_tokens``);
under a structure, with a logits processor running the same grammar engine (``GrammarLogitsProcessor``:
llguidance through ``constraints/grammar.py``), in leapdecode's dtype where its weights are floats, and
where they are quantized (which transformers cannot run) in the dtype a CPU runs fastest
(``hf_dtype``: bf16 with AMX or AVX512-BF16, else fp32, which an AVX2-only CPU computes natively
instead of converting bf16).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from ..runners import PLD_TOKENS, Runner, RunOutput, SkipPeer, strip_eos


def model_files(name_or_path: str):
    """(The HF-format directory of a model argument (registry name, directory, .gguf), the callable
    yielding the GGUF its weights are read from, or None); None for the in-process tiny models."""
    if name_or_path.startswith("tiny-random"):
        return None
    from ...models.loader import model_files as files

    return files(name_or_path)


@contextlib.contextmanager
def quiet_hf():
    """No weight-loading progress bars or deprecation chatter inside the bench's progress bar (transformers'
    messages below errors off, as ``convert.quiet_transformers``, and its progress bars and warnings too)."""
    from transformers.utils import logging as hf_logging

    from ...models.convert import quiet_transformers

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
    from ...models.loader import resolve_dtype

    if loaded.weights in ("int4", "int8"):
        return resolve_dtype("auto", loaded.device)
    return loaded.dtype


class HFShared:
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
        from ...core.runner import ModelRunner
        from ...constraints.grammar import compile_constraint

        if self._grammar_runner is None:
            self._grammar_runner = ModelRunner(self.loaded, prefix_cache_bytes=0)
        return compile_constraint(self._grammar_runner, **structure)

    def _load(self, path: Path, gguf):
        from transformers import GenerationConfig

        from ...models.hf_backend import transformers_model

        with quiet_hf():
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

    def __init__(self, shared: HFShared, name: str) -> None:
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
        with quiet_hf():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
        new = out[0, len(prompt_ids):].tolist()
        tokens, finish = strip_eos(new, self.eos)
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
