"""A decoder's layers in one kernel call (``qkernel.LayerStack``, ``kernels/layers.cpp``): the same
bits as ``Block.forward`` layer by layer, for logits, hidden states and the cache."""

import pytest
import torch
import torch.nn.functional as F

from leapdecode.models import kernel_library, qkernel

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def kernel():
    problem = kernel_library.kernel_problem()
    if problem is not None:
        pytest.skip(f"the kernels are not available here: {problem}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _special_rows(rows: int, width: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g) * torch.tensor([0.01, 1.0, 30.0, 3e4])[torch.randint(0, 4, (rows, width), generator=g)]
    x.view(-1)[:6] = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 3.0e38, -3.0e38])  # zeros, subnormals, near overflow
    return x.to(BF16)


def test_silu_mul_gives_torchs_bits_on_the_halves_of_a_gate_up_output(kernel):
    gu = _special_rows(9, 2 * 96, seed=1)  # rows of a multiple of 32: torch's vectorized SiLU throughout
    gate, up = gu.chunk(2, dim=-1)
    out = qkernel.silu_mul(gate, up)
    assert out is not None and out.shape == gate.shape and out.is_contiguous()
    assert torch.equal(_bits(out), _bits(F.silu(gate) * up))
    # every bf16 value as the gate: the table is torch's SiLU (NaN inputs give NaN, any payload)
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(BF16)[None]
    mine, ref = qkernel.silu_mul(every, torch.ones_like(every)), F.silu(every)
    finite = ~ref.isnan()
    assert finite.sum() > 60000 and torch.equal(_bits(mine[finite]), _bits(ref[finite]))
    assert mine[~finite].isnan().all()


@pytest.mark.parametrize("width", [1, 7, 37, 8 * 40 + 5])
def test_silu_mul_on_any_width_is_the_table_times_up_rounded_once(kernel, width):
    # widths that leave a tail after the 8-lane loop: each value goes through the same lookup and
    # one rounded product, on the SIMD path and on the tail alike
    gu = _special_rows(3, 2 * width, seed=width)
    gate, up = gu[:, :width], gu[:, width:]
    table = qkernel.silu_table()[:65536].view(BF16)
    ref = (table[gate.contiguous().view(torch.int16).long() & 0xFFFF].float() * up.float()).to(BF16)
    assert torch.equal(_bits(qkernel.silu_mul(gate, up)), _bits(ref))


def test_silu_mul_declines_what_it_does_not_take(kernel):
    x = torch.randn(2, 32)
    assert qkernel.silu_mul(x, x) is None  # fp32
    b = x.to(BF16)
    assert qkernel.silu_mul(b.t(), b.t()) is None  # a last dimension that is not contiguous
    assert qkernel.silu_mul(b, b[:1]) is None  # shapes differ


def _model(qkv_bias: bool, seed: int = 3):
    from leapdecode.models.blockquant import quantize_native
    from leapdecode.models.tiny import tiny_native

    model = tiny_native(seed=seed, qkv_bias=qkv_bias, layers=3, hidden=96, heads=6, kv_heads=2)
    quantize_native(model)
    model.attention = "invariant"
    return model


def _run(model, stack: bool, steps, layers=None):
    """Prefill 70 tokens (more than 64: op by op, both routes), then forwards of the steps'
    trees; logits, hidden states and the caches."""
    model.layers_kernel = stack
    g = torch.Generator().manual_seed(11)
    cache = model.new_cache(max_len=256)
    model.forward(torch.randint(0, 256, (1, 70), generator=g), cache)
    cache.commit()
    out = []
    for t, parents, commit in steps:
        hidden = []
        out.append(model.forward(torch.randint(0, 256, (1, t), generator=g), cache, parents=parents,
                                 hidden_states=hidden, layers=layers))
        out += hidden
        if commit:
            cache.commit()
        else:
            cache.rollback()
    return out + [cache.k.clone(), cache.v.clone()]


STEPS = [(1, None, True), (7, [-1, 0, 1, 1, 2, 4, 0], False), (64, None, True), (3, [-1, -1, 1], False),
         (1, None, True)]


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_the_stack_gives_the_logits_hidden_states_and_cache_of_the_layers_one_by_one(kernel, qkv_bias):
    model = _model(qkv_bias)
    stacked = _run(model, True, STEPS)
    assert model._stack[1] is not None  # it ran
    alone = _run(model, False, STEPS)
    assert len(stacked) == len(alone) == len(STEPS) * (1 + 1 + 3) + 2
    for i, (a, b) in enumerate(zip(stacked, alone)):
        assert torch.equal(a, b), i
    # layers skipped (self-speculation): the layers run, in their order, the same bits too
    assert all(torch.equal(a, b) for a, b in zip(_run(model, True, STEPS[:2], layers=[0, 2]),
                                                _run(model, False, STEPS[:2], layers=[0, 2])))


def test_a_replaced_projection_or_norm_gets_a_new_stack(kernel):
    model = _model(False)
    other = _model(False, seed=8)
    steps = STEPS[:2]
    first = _run(model, True, steps)
    stack = model._stack[1]
    model.layers[1].w_down = other.layers[1].w_down
    second = _run(model, True, steps)
    assert model._stack[1] is not stack and not torch.equal(first[0], second[0])
    assert all(torch.equal(a, b) for a, b in zip(second, _run(model, False, steps)))
    model.layers[2].mlp_norm = torch.nn.Parameter(model.layers[2].mlp_norm.detach() * 2)
    third = _run(model, True, steps)
    assert all(torch.equal(a, b) for a, b in zip(third, _run(model, False, steps)))
    assert not torch.equal(third[0], second[0])


def test_the_stack_refuses_what_does_not_fit(kernel, monkeypatch):
    model = _model(False)
    _run(model, True, STEPS[:1])
    stack = model._stack[1]
    cache = model.new_cache(max_len=32)
    cache.plan_append(None, 2)
    rows = torch.tensor([0, 1, 0], dtype=torch.long), torch.tensor([0, 1, 3])
    cos = model.rope_cos[:2].to(BF16)
    x = torch.randn(1, 2, 96).to(BF16)
    with pytest.raises(ValueError, match="unexpected"):
        stack.run(x.float(), cos, cos, cache.k, cache.v, 0, *rows, [0])
    with pytest.raises(ValueError, match="unexpected"):
        stack.run(x, cos, cos, cache.k, cache.v, 0, *rows, [3])  # no layer 3
    # the kernel checks its scratch room before it writes anything
    monkeypatch.setattr(stack, "_scratch_per_row", 1)
    before = cache.k.clone()
    with pytest.raises(RuntimeError, match=r"ld_decoder_layers failed \(-100\)"):
        stack.run(x, cos, cos, cache.k, cache.v, 0, *rows, [0])
    assert torch.equal(cache.k, before)
    # a hidden size the RMSNorm kernel does not take (not a multiple of 16): no stack
    layers = [(b.wqkv, b.wo, b.w_gate_up, b.w_down, b.attn_norm, b.mlp_norm) for b in model.layers]
    shape = dict(inter=192, n_heads=6, n_kv_heads=2, head_dim=16, eps=1e-6)
    assert qkernel.LayerStack.of(layers, hidden=96, **shape) is not None
    assert qkernel.LayerStack.of(layers, hidden=88, **shape) is None
    # a projection that is not a QLinear: layer by layer
    model.layers[0].wo = torch.nn.Linear(96, 96, bias=False).to(BF16)
    _run(model, True, STEPS[:1])
    assert model._stack[1] is None
