"""The reference loop: vanilla decoding in one screen, in the style of gpt-fast's ``generate.py``.

No proposer, no prefix cache, no scheduler, no task protocol: prefill the prompt, then one target
forward per token.  It is the oracle of the exactness tests (tests/test_lossless.py,
tests/test_reference.py): every method's output, through the whole engine (``Generation``'s
parts, the batched scheduler), must equal what this loop gives, token for token, greedy or seeded.

The few rules it shares with the engine are the ones that define the output, not its speed: the
prompt but its last token is prefilled in chunks aligned to position 0 (``prefill_chunk``), so
its keys and values have the bits every generation computes; the sampling transforms and draws
are ``core/sampling.py``'s (a seeded generation draws the token at sequence position i with
``position_uniform(seed, i)``; an unseeded one from a generator seeded by one draw of torch's
global generator, as ``Generation`` seeds its own); the output ends at an end-of-sequence token
(not kept), after ``max_new_tokens``, or when the context is full.
"""

from __future__ import annotations

from typing import Any

import torch

from .prefill import prefill_chunk
from .sampling import SamplingParams, greedy_tokens, position_uniform, sample, sample_at, target_probs


def reference_generate(model: Any, prompt_ids: list[int], max_new_tokens: int,
                       params: SamplingParams | None = None) -> tuple[list[int], str]:
    """Vanilla decoding of ``prompt_ids`` on ``model`` (a loaded model): the new tokens and the
    finish reason ("stop": an end-of-sequence token, "length": the limit or the full context)."""
    params = params or SamplingParams()
    decoder, ids = model.model, list(prompt_ids)
    device = decoder.device
    cache = decoder.new_cache(batch_size=1, max_len=min(model.max_seq_len, len(ids) + max_new_tokens))

    # the prompt but its last token, in chunks aligned to position 0; no logits needed
    chunk = prefill_chunk(decoder)
    for start in range(0, len(ids) - 1, chunk):
        piece = torch.tensor(ids[start : min(start + chunk, len(ids) - 1)], device=device)
        decoder.forward(piece[None], cache, logits_for=slice(0, 0))
        cache.commit()

    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item()))
    tokens, new = ids, []
    while len(new) < max_new_tokens:
        if len(tokens) >= model.max_seq_len:  # the context holds no position for another token
            return new, "length"
        # one token in, its logits out; its keys and values stay in the cache
        logits = decoder.forward(torch.tensor([[tokens[-1]]], device=device), cache)[0]  # [1, vocab]
        cache.commit()
        history = torch.tensor(tokens, device=device) if params.repetition_penalty != 1.0 else None
        if params.greedy:
            token = int(greedy_tokens(logits, params, history)[0])
        else:
            probs = target_probs(logits, params, history)[0]
            if params.seed is not None:
                token = sample_at(probs, position_uniform(params.seed, len(tokens)))
            else:
                token = int(sample(probs, generator)[0])
        if token in model.eos_token_ids:
            return new, "stop"
        new.append(token)
        tokens = tokens + [token]
    return new, "length"
