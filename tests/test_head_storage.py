"""Trained heads stored in int8 or bf16, run on torch's weight-only int8 kernel, and bundled with the
package (issue 17; docs/heads.md, "Storage, int8 execution and bundled heads").

1. Storage: ``save_head(..., storage="int8")`` writes every linear layer's weight as int8 codes with a
   per-row bf16 scale, the rest as before; every kind loads back (dequantized) within half a step of
   the scale, int8-stored heads keep their codes when run on the int8 kernel, bf16 storage loads the
   bf16-rounded weights; damaged files are ``HeadFileError``s; ``leapdecode heads export``.
2. int8 execution (``head_weights``): greedy identity with vanilla for every kind with trained heads
   whose int8 drafts are accepted, the ``head_int8_linears`` stat, the conversion made once per runner
   and never on the stored head, ``auto`` picking int8 on a quantized target only; typed errors.
3. Bundled heads: found after the store (the store wins), listed as bundled, used by ``auto``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

import leapdecode
from leapdecode import ModelRunner
from leapdecode.cli import main as cli_main
from leapdecode.errors import HeadFileError, HeadNotFoundError, InvalidParameterError
from leapdecode.models.kernel_library import kernel_problem
from leapdecode.models.qkernel import QLinear
from leapdecode.models.quant import Int8Linear, quantize_model
from leapdecode.models.tiny import tiny_loaded
from leapdecode.proposers import METHODS
from leapdecode.proposers.heads import store as head_store
from leapdecode.proposers.heads.common import fingerprint, head_weights_for, int4_linear, int8_copy, quantized_copy
from leapdecode.proposers.heads.eagle import DraftKV, Eagle3Head, EagleHead, EagleProposer, KernelDraftKV
from leapdecode.proposers.heads.hydra import HydraHeads
from leapdecode.proposers.heads.medusa import MedusaHeads
from leapdecode.proposers.heads.store import (INT8_SCALE, MANIFEST, WEIGHTS, export_head, find_head, install,
                                              list_heads, load_head, read_head, save_head, stored_kind)
from helpers.heads import PROMPTS, vanilla

EIGHT_BIT = (Int8Linear, QLinear)  # what a head's linears run on under head_weights=int8 (heads/common.int8_linear)

KINDS = ("medusa", "hydra", "eagle", "eagle3")
METHOD = {"medusa": "medusa", "hydra": "hydra", "eagle": "eagle", "eagle3": "eagle"}
REAL_BUNDLED_ROOT = head_store.bundled_root  # before the fixture below replaces it
LINEARS = {"medusa": 3, "hydra": 6, "eagle": 5, "eagle3": 6}  # nn.Linear layers of random_head(kind)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    """A model cache of this test's own, and an empty bundled-heads root (the package's real one may
    hold heads for real models later)."""
    monkeypatch.setenv("LEAPDECODE_CACHE", str(tmp_path / "cache"))
    bundled = tmp_path / "bundled"
    bundled.mkdir()
    monkeypatch.setattr(head_store, "bundled_root", lambda: bundled)
    return bundled


def random_head(kind: str, model, seed: int = 0, std: float = 0.05) -> torch.nn.Module:
    torch.manual_seed(seed)
    cls = {"medusa": MedusaHeads, "hydra": HydraHeads, "eagle": EagleHead, "eagle3": Eagle3Head}[kind]
    head = cls.for_target(model, heads=3) if kind in ("medusa", "hydra") else cls.for_target(model)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * std)  # norms too: their storage is checked
    return head.eval()


def write(kind, model, directory: Path, seed: int = 0, storage=None) -> Path:
    save_head(directory, random_head(kind, model, seed), {"target": {"name": model.name, "fingerprint":
                                                                     fingerprint(model)}, "steps": 0, "data": {}},
              storage=storage)
    return directory


def gen(model, ids, kind, head_dir, runner=None, **kw):
    options = {"head": str(head_dir), **kw.pop("options", {})}
    return leapdecode.generate(runner or ModelRunner(model), prompt_ids=ids, method=METHOD[kind], options=options,
                               **kw)


# ============================================================================ 1. storage
@pytest.mark.parametrize("kind", KINDS)
def test_int8_storage_round_trip(tiny, tmp_path, kind):
    model = tiny(seed=0)
    head = random_head(kind, model)
    d = write(kind, model, tmp_path / "h", storage="int8")
    manifest = json.loads((d / MANIFEST).read_text())
    assert manifest["storage"] == "int8" and manifest["kind"] == kind
    raw = st_load((d / WEIGHTS).read_bytes())
    lin = head_store.linear_weights(head)
    assert len(lin) == LINEARS[kind]
    float_state = head.state_dict()
    for key, value in float_state.items():
        if key in lin:
            q, scale = raw[key], raw[key + INT8_SCALE]
            assert q.dtype == torch.int8 and q.shape == value.shape and scale.dtype == torch.bfloat16
            assert int(q.abs().max()) == 127  # each row's largest weight is code +-127 (absmax scale)
        else:
            assert torch.equal(raw[key], value), key  # the rest as before (the head's dtype)
    assert set(raw) == set(float_state) | {k + INT8_SCALE for k in lin}
    loaded, m = load_head(kind, model, d)
    assert m["storage"] == "int8"
    for key, value in loaded.state_dict().items():
        if key in lin:
            scale = raw[key + INT8_SCALE].float()[:, None]
            assert torch.equal(value, raw[key].float() * scale)  # dequantized exactly
            assert bool(((value - float_state[key]).abs() <= 0.5 * scale * (1 + 1e-2)).all())
        else:
            assert torch.equal(value, float_state[key])


def test_int8_stored_codes_survive_int8_execution(tiny, tmp_path):
    """An int8-stored head loaded for an fp32 target and run on the int8 kernel multiplies by its
    stored codes and scales, bit for bit (one quantizer for both)."""
    model = tiny(seed=0)
    d = write("eagle", model, tmp_path / "h", storage="int8")
    raw = st_load((d / WEIGHTS).read_bytes())
    run = int8_copy(load_head("eagle", model, d)[0])
    for name in ("fc", "wqkv", "wo", "w_gate_up", "w_down"):
        layer = getattr(run, name)  # torch's Int8Linear, or the block kernel's 8-bit codes (per-row scales)
        assert isinstance(layer, EIGHT_BIT), type(layer)
        stored = raw[f"{name}.weight"].float() * raw[f"{name}.weight{INT8_SCALE}"].float()[:, None]
        assert torch.equal(layer.dequantize(), stored), name
    if kernel_problem() is None:  # where the block kernel runs, the head's layers are on it
        assert all(isinstance(getattr(run, name), QLinear) for name in ("fc", "wqkv", "wo", "w_gate_up", "w_down"))


def test_bf16_storage_and_size(tiny, tmp_path):
    model = tiny(seed=0)
    head = random_head("eagle", model)
    sizes = {}
    for storage in (None, "bf16", "int8"):
        d = write("eagle", model, tmp_path / str(storage), storage=storage)
        sizes[storage] = (d / WEIGHTS).stat().st_size
        manifest = json.loads((d / MANIFEST).read_text())
        assert manifest.get("storage") == storage
    raw = st_load((tmp_path / "bf16" / WEIGHTS).read_bytes())
    assert all(v.dtype == torch.bfloat16 for v in raw.values())
    loaded = load_head("eagle", model, tmp_path / "bf16")[0]
    for key, value in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value.to(torch.bfloat16).float()), key
    # fp32 -> bf16 halves the weights, int8 quarters them (plus small scales and headers)
    assert sizes["bf16"] < 0.55 * sizes[None] and sizes["int8"] < 0.3 * sizes[None], sizes


def test_saving_float_weights_never_claims_int8(tiny, tmp_path):
    """A manifest handed over from an int8 head (e.g. the export's source) does not survive a save of
    float weights: the manifest always says how the file is stored."""
    model = tiny(seed=0)
    d = write("medusa", model, tmp_path / "a", storage="int8")
    head, manifest = read_head(d)
    save_head(tmp_path / "b", head, manifest)
    assert "storage" not in json.loads((tmp_path / "b" / MANIFEST).read_text())
    assert load_head("medusa", model, tmp_path / "b")[0] is not None
    with pytest.raises(InvalidParameterError, match="storage"):
        save_head(tmp_path / "c", head, manifest, storage="int4")


def _rewrite(d: Path, edit) -> None:
    raw = st_load((d / WEIGHTS).read_bytes())
    edit(raw)
    (d / WEIGHTS).write_bytes(st_save(raw))


@pytest.mark.parametrize("damage", ["no_scale", "scale_shape", "float_codes", "manifest_storage",
                                    "manifest_says_float", "truncated"])
def test_damaged_int8_heads_are_head_file_errors(tiny, tmp_path, damage):
    model = tiny(seed=0)
    d = write("eagle", model, tmp_path / "h", storage="int8")
    key = "wqkv.weight"
    if damage == "no_scale":
        _rewrite(d, lambda raw: raw.pop(key + INT8_SCALE))
    elif damage == "scale_shape":
        _rewrite(d, lambda raw: raw.__setitem__(key + INT8_SCALE, raw[key + INT8_SCALE][:-1].contiguous()))
    elif damage == "float_codes":
        _rewrite(d, lambda raw: raw.__setitem__(key, raw[key].float()))
    elif damage == "truncated":
        data = (d / WEIGHTS).read_bytes()
        (d / WEIGHTS).write_bytes(data[: len(data) // 2])
    else:
        m = json.loads((d / MANIFEST).read_text())
        if damage == "manifest_storage":
            m["storage"] = "int4"
        else:
            m.pop("storage")
        (d / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(HeadFileError):
        load_head("eagle", model, d)
    with pytest.raises(HeadFileError):
        export_head(d, tmp_path / "out", "bf16")


def test_heads_export_cli(tiny, tmp_path, capsys):
    model = tiny(seed=0)
    src = write("hydra", model, tmp_path / "src")
    before = load_head("hydra", model, src)[0]
    assert cli_main(["heads", "export", str(src), str(tmp_path / "i8"), "--storage", "int8"]) == 0
    assert "int8" in capsys.readouterr().out
    m = json.loads((tmp_path / "i8" / MANIFEST).read_text())
    assert m["storage"] == "int8" and m["exported_from"]["storage"] is None
    assert m["target"] == json.loads((src / MANIFEST).read_text())["target"]
    assert sorted(p.name for p in (tmp_path / "i8").iterdir()) == [WEIGHTS, MANIFEST]  # no temporary files left
    i8 = load_head("hydra", model, tmp_path / "i8")[0]
    # int8 -> bf16 again: a head of every storage loads; the weights stay within the int8 step
    assert cli_main(["heads", "export", str(tmp_path / "i8"), str(tmp_path / "b16"), "--storage", "bf16"]) == 0
    b16 = load_head("hydra", model, tmp_path / "b16")[0]
    for key, w in before.state_dict().items():
        step = w.abs().amax(-1, keepdim=True) / 127 if key in head_store.linear_weights(before) else 0
        assert bool(((i8.state_dict()[key] - w).abs() <= 0.51 * step).all()), key
        assert torch.allclose(b16.state_dict()[key], i8.state_dict()[key], rtol=1e-2, atol=1e-6), key
    # exported heads decode exactly
    ids = model.tokenizer.encode(PROMPTS[0])
    assert gen(model, ids, "hydra", tmp_path / "i8", max_new_tokens=20).tokens == \
        vanilla(model, ids, max_new_tokens=20).tokens
    capsys.readouterr()
    # a missing or corrupt source: exit 2 with the typed error's message
    assert cli_main(["heads", "export", str(tmp_path / "nowhere"), str(tmp_path / "x"), "--storage", "int8"]) == 2
    assert "not a directory of a trained head" in capsys.readouterr().err
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / MANIFEST).write_text("{not json")
    assert cli_main(["heads", "export", str(tmp_path / "bad"), str(tmp_path / "x"), "--storage", "int8"]) == 2
    assert "corrupt" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    with pytest.raises(SystemExit):
        cli_main(["heads", "export", str(src), str(tmp_path / "x"), "--storage", "int4"])
    with pytest.raises(HeadFileError):
        export_head(tmp_path / "nowhere", tmp_path / "x", "int8")
    with pytest.raises(InvalidParameterError):
        export_head(src, tmp_path / "x", "fp8")


# ============================================================================ 2. int8 execution
@pytest.fixture(scope="module")
def no_eos(tiny):
    return dataclasses.replace(tiny(seed=0), eos_token_ids=set())


@pytest.fixture
def trained(trained_head_dir):
    """``trained(kind)``: the directory of a head of ``kind`` trained for a few seconds (conftest)."""
    return trained_head_dir


@pytest.mark.parametrize("kind", KINDS)
def test_int8_execution_greedy_identity(tiny, trained, kind):
    """Greedy output with ``head_weights=int8`` is vanilla's, the drafts ran on int8 linears (the stat)
    and were accepted: fewer target forwards than vanilla, about as many as the float head's."""
    model = tiny(seed=0)
    head_dir = trained(kind)
    forwards = {"int8": 0, "bf16": 0}
    vanilla_forwards = 0
    for i, prompt in enumerate(PROMPTS):
        ids = model.tokenizer.encode(prompt)
        n = 16 + 5 * i
        ref = vanilla(model, ids, max_new_tokens=n)
        vanilla_forwards += ref.stats["target_forwards"]
        for hw in ("int8", "int4", "bf16"):
            if hw == "int4" and kernel_problem() is not None:
                continue  # (int4 runs on the block kernel only: test_int4_needs_the_block_kernel)
            out = gen(model, ids, kind, head_dir, max_new_tokens=n, options={"head_weights": hw})
            assert out.tokens == ref.tokens, (kind, hw, prompt)
            assert out.stats["head_int8_linears"] == (LINEARS[kind] if hw != "bf16" else 0)
            if METHOD[kind] == "eagle":  # its layer on the kernels' route wherever its linears are QLinears
                assert out.stats["eagle_layer_kernel"] == int(hw != "bf16" and kernel_problem() is None)
            forwards[hw] = forwards.get(hw, 0) + out.stats["target_forwards"]
    assert forwards["int8"] < 0.8 * vanilla_forwards, (forwards, vanilla_forwards)
    assert forwards["int8"] <= 1.25 * forwards["bf16"], forwards
    assert forwards.get("int4", 0) <= 1.25 * forwards["bf16"], forwards


def test_int8_head_is_close_to_the_float_head_but_not_it(tiny, tmp_path):
    """The int8 copy's outputs are the float head's within the quantization error, and not bitwise
    equal (the kernel really runs); the stored head keeps its float layers."""
    model = tiny(seed=0)
    head = random_head("eagle", model)
    run = int8_copy(head)
    assert sum(isinstance(m, EIGHT_BIT) for m in run.modules()) == 5
    assert not any(isinstance(m, EIGHT_BIT) for m in head.modules())
    torch.manual_seed(1)
    f, e = torch.randn(7, 64), torch.randn(7, 64)
    with torch.inference_mode():
        ref, k_ref, _ = head(f, e, torch.arange(7))
        out, k, _ = run(f, e, torch.arange(7))
    err = float((out - ref).norm() / ref.norm())
    assert 0 < err < 0.05, err
    assert float((k - k_ref).norm() / k_ref.norm()) < 0.05


def test_conversion_once_per_runner_never_on_the_stored_head(tiny, tmp_path):
    model = tiny(seed=0)
    d = write("eagle", model, tmp_path / "h")
    runner = ModelRunner(model)
    ids = model.tokenizer.encode(PROMPTS[0])
    nets = []
    for _ in range(2):
        g = leapdecode.start_generation(runner, prompt_ids=ids, method="eagle",
                                        options={"head": str(d), "head_weights": "int8"}, max_new_tokens=8)
        g.run()
        nets.append(g.proposer.net)
        assert g.proposer.net is not g.proposer.head
        assert not any(isinstance(m, EIGHT_BIT) for m in g.proposer.head.modules())
    assert nets[0] is nets[1]  # the runner's memory: converted once
    g = leapdecode.start_generation(ModelRunner(model), prompt_ids=ids, method="eagle",
                                    options={"head": str(d), "head_weights": "int8"}, max_new_tokens=8)
    g.run()
    assert g.proposer.net is not nets[0]  # another runner converts its own


def _quantized_tiny():
    """A tiny target on int8 weights (its own object: the session's shared models stay fp32); the
    same fingerprint as ``tiny(seed=0)``."""
    lm = tiny_loaded(name="tiny-random:0", seed=0, layers=2, hidden=64, heads=4, kv_heads=2)
    quantize_model(lm.model, "int8")
    return lm


def test_auto_is_int8_on_a_quantized_target_only(tiny, tmp_path):
    fp32 = tiny(seed=0)
    q = _quantized_tiny()
    assert fingerprint(q) == fingerprint(fp32)
    assert head_weights_for("auto", fp32) == "bf16" and head_weights_for("auto", q) == "int8"
    assert head_weights_for("bf16", q) == "bf16" and head_weights_for("int8", fp32) == "int8"
    for kind in ("medusa", "eagle"):
        d = write(kind, fp32, tmp_path / kind)
        for prompt in PROMPTS[:4]:
            ids = q.tokenizer.encode(prompt)
            ref = vanilla(q, ids, max_new_tokens=24)
            out = gen(q, ids, kind, d, max_new_tokens=24)  # head_weights=auto
            assert out.tokens == ref.tokens, (kind, prompt)
            assert out.stats["head_int8_linears"] == LINEARS[kind]
            out = gen(q, ids, kind, d, max_new_tokens=24, options={"head_weights": "bf16"})
            assert out.tokens == ref.tokens and out.stats["head_int8_linears"] == 0
        assert gen(fp32, ids, kind, d, max_new_tokens=8).stats["head_int8_linears"] == 0


def test_head_weights_is_a_typed_option(tiny, tmp_path):
    for method in ("medusa", "hydra", "eagle"):
        cfg = METHODS[method].config.from_options({"head_weights": "int8"})
        assert cfg.head_weights == "int8"
        assert METHODS[method].config.from_options({}).head_weights == "auto"
        assert METHODS[method].config.from_options({"head_weights": "int4"}).head_weights == "int4"
        with pytest.raises(InvalidParameterError):
            METHODS[method].config.from_options({"head_weights": "fp8"})
    model = tiny(seed=0)
    with pytest.raises(InvalidParameterError):
        EagleProposer(model, random_head("eagle", model), head_weights="fp8")
    with pytest.raises(InvalidParameterError):
        head_weights_for("fp8", model)


def test_int4_needs_the_block_kernel(tiny, monkeypatch):
    """``head_weights=int4`` where the block kernel cannot run is a typed error naming why."""
    from leapdecode.models import kernel_library

    monkeypatch.setattr(kernel_library, "kernel_problem", lambda: "no compiler (planted)")
    with pytest.raises(InvalidParameterError, match="planted"):
        head_weights_for("int4", tiny(seed=0))


def test_int4_linear_is_groupwise_4_bit(tiny):
    """``int4_linear``: each group of 32 weights is ``s * c + z`` with codes 0..15, its minimum ``z``
    and ``s`` = range / 15 in fp16, the codes rounded to nearest: every weight within half a step
    of its group's scale; the layer computes with those weights (the kernel's activation rounding
    apart); a copy's linears are int4 ones, and it drafts apart from the int8 copy."""
    if kernel_problem() is not None:
        pytest.skip(f"the block-quantized kernel is not available here: {kernel_problem()}")
    torch.manual_seed(3)
    lin = torch.nn.Linear(96, 48)
    q = int4_linear(lin)
    assert isinstance(q, QLinear) and q.parts[0].bits == 4 and q.parts[0].group == 32
    w = q.parts[0].dequantize()[:48].float()
    ref = lin.weight.detach().float()
    groups = ref.reshape(48, 3, 32)
    step = ((groups.amax(-1) - groups.amin(-1)) / 15)[..., None].expand(48, 3, 32).reshape(48, 96)
    assert bool(((w - ref).abs() <= 0.5 * step * 1.01 + 1e-6).all())
    assert not torch.equal(w, ref)
    x = torch.randn(5, 96)
    with torch.inference_mode():
        y = q(x).float()
    exact = x @ w.T + lin.bias.detach()
    assert float((y - exact).norm() / exact.norm()) < 0.02
    assert int4_linear(torch.nn.Linear(40, 48)) is None  # 40 columns: no groups of 32
    model = tiny(seed=0)
    head = random_head("eagle", model)
    four, eight = quantized_copy(head, "int4"), quantized_copy(head, "int8")
    assert all(p.bits == 4 for m in four.modules() if isinstance(m, QLinear) for p in m.parts)
    assert sum(isinstance(m, QLinear) for m in four.modules()) == LINEARS["eagle"]
    f, e = torch.randn(3, 64), torch.randn(3, 64)
    with torch.inference_mode():
        assert not torch.equal(four(f, e, torch.arange(3))[0], eight(f, e, torch.arange(3))[0])


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_kernel_draft_layer_matches_the_torch_layer(tiny, kind):
    """``KernelDraftKV`` (the draft layer on the kernels' route over static buffers) gives the torch
    layer's outputs (``DraftKV``) up to rounding: a feed of more rows than one stack call takes
    (chunked), tree levels attending to committed entries and their pending ancestors, the pending
    entries dropped and overwritten by the next feed, and its buffers grown from 8 slots.  Wrong
    attended entries give other outputs (the comparison can fail)."""
    if kernel_problem() is not None:
        pytest.skip(f"the block-quantized kernel is not available here: {kernel_problem()}")
    model = tiny(seed=0)
    net = quantized_copy(random_head(kind, model, std=0.1), "int8")
    dt, cpu = torch.float32, torch.device("cpu")
    ref, ker = DraftKV(net, dt, cpu), KernelDraftKV.of(net, dt, cpu, capacity=8)
    assert ker is not None and ker.kernel and not ref.kernel
    torch.manual_seed(4)
    f, e = torch.randn(80, 64), torch.randn(80, 64)

    def close(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm()) < 0.03

    with torch.inference_mode():  # a short context first: each entry weighs in the attention
        assert close(ker.feed(f[:3], e[:3], torch.arange(3)), ref.feed(f[:3], e[:3], torch.arange(3)))
        levels = [([3, 3, 3], [[0], [1], [2]]), ([4, 4, 4], [[0, 3], [1, 4], [0, 5]])]
        for i, (pos, rows) in enumerate(levels):
            a = ker.level(f[3 + 3 * i : 6 + 3 * i], e[3 + 3 * i : 6 + 3 * i], torch.tensor(pos), rows)
            b = ref.level(f[3 + 3 * i : 6 + 3 * i], e[3 + 3 * i : 6 + 3 * i], torch.tensor(pos), rows)
            assert close(a, b), i
        wrong = ker.level(f[9:12], e[9:12], torch.tensor([5] * 3), [[0, 3, 6], [0, 3, 7], [0, 3, 8]])
        right = ref.level(f[9:12], e[9:12], torch.tensor([5] * 3), [[0, 3, 6], [1, 4, 7], [0, 5, 8]])
        assert close(wrong[0], right[0]) and not close(wrong[1:], right[1:])
        ker.drop_pending()
        ref.drop_pending()
        assert ker.committed == ref.committed == 3
        assert close(ker.feed(f[12:13], e[12:13], torch.tensor([3])), ref.feed(f[12:13], e[12:13], torch.tensor([3])))
        # more rows than one stack call takes: fed in chunks
        assert close(ker.feed(f[:70], e[:70], torch.arange(4, 74)), ref.feed(f[:70], e[:70], torch.arange(4, 74)))
        assert close(ker.feed(f[70:71], e[70:71], torch.tensor([74])), ref.feed(f[70:71], e[70:71], torch.tensor([74])))
        assert ker.committed == ref.committed == 75 and ker.kv.shape[4] >= 75


def test_no_int8_kernel_here(tiny, monkeypatch):
    """Where torch's int8 kernel cannot run, ``int8`` is a typed error and ``auto`` keeps the float head."""
    import leapdecode.proposers.heads.common as heads_common

    monkeypatch.setattr(heads_common, "kernel_problem", lambda weights, device: "no int8 kernel (planted)")
    with pytest.raises(InvalidParameterError, match="planted"):
        head_weights_for("int8", tiny(seed=0))
    assert head_weights_for("auto", _quantized_tiny()) == "bf16"


def test_cli_option_head_weights(tmp_path, capsys):
    """``--option head_weights=int8`` reaches the proposer, and ``--weights int8`` makes auto pick int8."""
    from leapdecode.models.loader import load

    model = load("tiny-random", dtype="fp32")
    d = write("medusa", model, tmp_path / "m")
    base = ["generate", "-m", "tiny-random", "--method", "medusa", "--option", f"head={d}", "--max-new-tokens",
            "12", "--json"]
    for extra, linears in ((["--dtype", "fp32", "--option", "head_weights=int8"], 3), (["--dtype", "fp32"], 0),
                           (["--weights", "int8"], 3), (["--weights", "int8", "--option", "head_weights=bf16"], 0)):
        assert cli_main(base + extra + ["hello hello"]) == 0, extra
        assert json.loads(capsys.readouterr().out)["stats"]["head_int8_linears"] == linears, extra
    assert cli_main(base + ["--option", "head_weights=fp8", "hello"]) == 2
    assert "head_weights" in capsys.readouterr().err


@pytest.mark.parametrize("window", [0, 5, 128, 300])
def test_eagle_prompt_window_keeps_only_what_begin_reads(tiny, tmp_path, window):
    """EAGLE keeps the prompt's hidden states only for the last ``prompt_window`` positions seen (the
    features are made in ``begin``, by whichever copy of the head runs); what ``begin`` holds is the
    window, equal to the features computed from the prefill's whole chunks."""
    model = tiny(seed=0)
    d = write("eagle3", model, tmp_path / "h")
    ids = model.tokenizer.encode("def f(x):\n    return x\n" * 30)  # more than two 256-token chunks
    g = leapdecode.start_generation(ModelRunner(model), prompt_ids=ids, method="eagle", max_new_tokens=4,
                                    options={"head": str(d), "prompt_window": window, "head_weights": "bf16"})
    prop = g.proposer
    calls, held, kept = [], [], {}
    observe_prompt, begin = prop.observe_prompt, prop.begin

    def spy_observe(start, hidden):
        calls.append((start, [h.clone() for h in hidden]))
        observe_prompt(start, hidden)
        held.append(len(prop._prompt_feats))

    def spy_begin(ctx, tokens):
        begin(ctx, tokens)
        kept.update(prop.feats)

    prop.observe_prompt, prop.begin = spy_observe, spy_begin
    assert g.run().tokens == vanilla(model, ids, max_new_tokens=4).tokens
    last = len(ids) - 2  # the last prefilled position
    assert sorted(kept) == list(range(max(0, last - window + 1), last + 1))
    assert (calls or window == 0) and max(held, default=0) <= window  # (window 0: no prompt features asked)
    matched = set()
    for start, hidden in calls:
        with torch.inference_mode():
            full = prop.head.input_features(model.model, hidden, slice(None))
        for i in range(full.shape[0]):
            if start + i in kept:
                assert torch.allclose(kept[start + i], full[i], atol=1e-5), start + i
                matched.add(start + i)
    assert matched == set(kept)


# ============================================================================ 3. bundled heads
def test_eagle_fuses_observed_states_when_it_next_drafts(tiny, trained):
    """``observe`` keeps the verified rows' states only; ``propose`` fuses everything observed since
    its last call in one ``features_of`` call (so ``auto``'s steps by other drafters cost no fusing),
    and the features it feeds are those the head computes from the forward's states directly."""
    model = tiny(seed=0)
    ids = model.tokenizer.encode(PROMPTS[0])
    g = leapdecode.start_generation(ModelRunner(model), prompt_ids=ids, method="eagle", max_new_tokens=24,
                                    options={"head": str(trained("eagle3")), "head_weights": "bf16"})
    prop = g.proposer
    observed, fused, propose, observe, fuse = {}, {}, prop.propose, prop.observe, prop._fuse_observed
    begin = prop.begin

    def spy_begin(ctx, tokens):
        begin(ctx, tokens)
        fused.clear()  # the prompt window's features, fused in begin (test_eagle_prompt_window_...)

    def spy_observe(tokens, tree, verdict, logits, hidden=None):
        observe(tokens, tree, verdict, logits, hidden)
        first = len(tokens) - len(verdict.tokens) - 1
        rows = [0] + [a + 1 for a in verdict.accepted]
        with torch.inference_mode():
            want = prop.net.input_features(model.model, hidden, rows)
        for i in range(len(rows)):
            assert first + i in prop._states and first + i not in prop.feats  # kept, not fused yet
            observed[first + i] = want[i]

    def spy_fuse():
        pending = set(prop._states)
        fuse()
        assert not prop._states
        fused.update((p, prop.feats[p].clone()) for p in pending)

    def spy_propose(tokens, budget):
        tree = propose(tokens, budget)
        assert not prop._states
        return tree

    prop.begin, prop.observe, prop._fuse_observed, prop.propose = spy_begin, spy_observe, spy_fuse, spy_propose
    out = g.run()
    assert out.tokens == vanilla(model, ids, max_new_tokens=24).tokens
    assert out.stats["mean_accepted"] > 1.0  # multi-row verdicts were observed
    assert fused and set(fused) <= set(observed) and len(fused) >= len(observed) - 3
    for p, f in fused.items():
        assert torch.allclose(f, observed[p], atol=1e-5), p


def test_bundled_head_found_after_the_store(tiny, tmp_path, _cache):
    bundled = _cache
    model = tiny(seed=0)
    ids = model.tokenizer.encode(PROMPTS[2])
    with pytest.raises(HeadNotFoundError, match="bundled"):
        load_head("eagle", model)
    write("eagle", model, bundled / "tiny-eagle", seed=1, storage="int8")
    write("medusa", tiny(seed=1), bundled / "other-model-medusa")  # another target's: never picked
    (bundled / "broken").mkdir()
    (bundled / "broken" / MANIFEST).write_text("{")  # skipped by the lookup, reported by the list
    assert find_head(("eagle3", "eagle"), model) == ("eagle", bundled / "tiny-eagle")
    assert stored_kind(("medusa",), model) is None
    out = leapdecode.generate(ModelRunner(model), prompt_ids=ids, method="eagle", max_new_tokens=20)
    assert out.tokens == vanilla(model, ids, max_new_tokens=20).tokens and out.stats["eagle_steps"] > 0
    # the store wins, also with another of the kinds asked for
    write("eagle", model, tmp_path / "mine", seed=2)
    mine = install(tmp_path / "mine", model)
    assert find_head(("eagle3", "eagle"), model) == ("eagle", mine)
    write("eagle3", model, bundled / "tiny-eagle3", seed=3)
    assert find_head("eagle3", model) == ("eagle3", bundled / "tiny-eagle3")
    assert find_head(("eagle3", "eagle"), model) == ("eagle", mine)
    head, manifest = load_head(("eagle3", "eagle"), model)
    assert manifest["kind"] == "eagle" and "storage" not in manifest
    ref = load_head("eagle", model, mine)[0]
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), ref.state_dict().values()))


def test_heads_list_marks_bundled(tiny, tmp_path, _cache, capsys):
    bundled = _cache
    model = tiny(seed=0)
    write("medusa", model, tmp_path / "mine")
    install(tmp_path / "mine", model)
    write("hydra", model, bundled / "tiny-hydra", storage="int8")
    (bundled / "not-a-head").mkdir()  # no manifest: not listed
    heads = list_heads()
    assert [(h["kind"], h["bundled"], h.get("storage")) for h in heads] == [("medusa", False, None),
                                                                           ("hydra", True, "int8")]
    assert cli_main(["heads", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and "[bundled]" not in lines[0] and "[bundled]" in lines[1] and "int8" in lines[1]
    assert cli_main(["heads", "list", "--json"]) == 0
    assert [h["bundled"] for h in json.loads(capsys.readouterr().out)] == [False, True]


def test_auto_uses_a_bundled_head(tiny, _cache):
    model = tiny(seed=0)
    write("eagle", model, _cache / "tiny-eagle", storage="int8")
    ids = model.tokenizer.encode(PROMPTS[0])
    g = leapdecode.start_generation(ModelRunner(model), prompt_ids=ids, method="auto", max_new_tokens=20)
    assert "head" in g.proposer.arms and isinstance(g.proposer.head, EagleProposer)
    assert g.run().tokens == vanilla(model, ids, max_new_tokens=20).tokens


def test_the_packages_bundled_heads_are_readable():
    """Whatever the package ships in ``bundled_heads/`` (now: a README only) is a readable head."""
    root = REAL_BUNDLED_ROOT()
    assert root == Path(leapdecode.__file__).parent / "bundled_heads"
    assert root.is_dir() and (root / "README.md").is_file()
    for d in sorted(p for p in root.iterdir() if p.is_dir() and (p / MANIFEST).exists()):
        module, manifest = read_head(d)
        assert manifest["kind"] in head_store.KINDS
        assert (d / WEIGHTS).stat().st_size <= 25 * 10**6  # the limit for a committed head


@pytest.mark.parametrize("kind", KINDS)
def test_heads_on_the_default_formats_quantized_head_give_vanillas_tokens(tmp_path, kind):
    """On a target in the default format (block-quantized layers and output head, invariant
    attention) every head kind scores its drafts with the target's quantized head -- whole, or
    FR-Spec's subset of its rows (``draft_vocab=64`` of 259) -- and gives vanilla's greedy tokens,
    without ever dequantizing the head."""
    if kernel_problem() is not None:
        pytest.skip(f"the block-quantized kernel is not available here: {kernel_problem()}")
    q = leapdecode.load("tiny-random", weights="int4")
    assert isinstance(q.model.lm_head, QLinear)
    d = write(kind, q, tmp_path / kind)
    for prompt in PROMPTS[:3]:
        ids = q.tokenizer.encode(prompt)
        ref = vanilla(q, ids, max_new_tokens=24)
        for options in ({}, {"draft_vocab": 64}):
            out = gen(q, ids, kind, d, max_new_tokens=24, options=options)
            assert out.tokens == ref.tokens, (kind, prompt, options)
            assert out.stats["draft_nodes"] > 0
    assert getattr(q.model, "_head_weight", None) is None
