"""Tiny masked-diffusion LMs for the decoder tests: ``tiny-llada`` / ``tiny-dream`` loaded once per
session, a dLLM that predicts one token everywhere, and a generate shorthand (tests/test_diffusion_apd.py,
test_diffusion_s2d2.py, test_diffusion_elastic_cache.py, test_diffusion_decoders.py,
test_diffusion_policies_c.py)."""

from __future__ import annotations

import torch

_TINY_DLLMS: dict = {}
CONFIDENT_TOKEN = 65  # what confident_dllm() predicts everywhere


def tiny_dllm(family: str, seed: int):
    """``tiny-llada:SEED`` / ``tiny-dream:SEED``, loaded once per session (decoders never modify it)."""
    from leapdecode.diffusion import load

    if (family, seed) not in _TINY_DLLMS:
        _TINY_DLLMS[(family, seed)] = load(f"tiny-{family}:{seed}")
    return _TINY_DLLMS[(family, seed)]


def confident_dllm(family: str):
    """A fresh tiny dLLM that predicts CONFIDENT_TOKEN everywhere with confidence ~0.999 (< 1): the
    attention and MLP outputs are zeroed, every embedding shares a large first coordinate, and
    only the head row of CONFIDENT_TOKEN reads it."""
    from leapdecode.diffusion.tiny import tiny_model

    m = tiny_model(family, seed=5)
    net = m.network
    with torch.no_grad():
        for b in net.blocks:
            b.o.weight.zero_()
            b.down.weight.zero_()
        net.embed.weight[:, 0] = 10.0
        net.head.weight.zero_()
        net.head.weight[CONFIDENT_TOKEN, 0] = 2.0
    return m


def run_dllm(m, prompt, method, gen_len, block, **options):
    """``diffusion.generate`` of ``gen_len`` tokens in blocks of ``block`` with the method's options."""
    from leapdecode.diffusion import generate

    return generate(m, prompt, method=method, options=options, max_new_tokens=gen_len, block_size=block)
