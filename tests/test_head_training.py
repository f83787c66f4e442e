"""Head training in steps that add up (issue 46, item 1): data shards that accumulate across runs,
Magpie requests the target writes itself, an earlier run's token file, ``--init`` from a trained
head, ``--resume``, and the per-category teacher-forced accuracy after every run (heads_eval), on a
tiny random model."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from leapdecode.results.page import head_table, heads_section, read_head_reports
from leapdecode.bench.workloads import WorkloadError, find_default_workload
from leapdecode.cli import main as cli_main
from leapdecode.errors import HeadMismatchError, InvalidParameterError
from leapdecode.training import accuracy as heads_eval
from leapdecode.training import data as heads_data
from leapdecode.training.data import Shards, extract, plan
from leapdecode.training.train import CHECKPOINT, Recipe, default_workdir, new_head, train_head
from leapdecode.proposers.heads.common import fingerprint
from leapdecode.proposers.heads.eagle import Eagle3Head

PROMPTS = [f"item {i}: the cat sat on mat {i % 3}" for i in range(12)]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LEAPDECODE_CACHE", str(tmp_path / "cache"))


def _prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


def _recipe(data, **kw) -> Recipe:
    base = dict(kind="eagle3", data=tuple(str(d) for d in data), max_prompts=3, gen_tokens=6, text_chunks=2,
                seq_len=32, steps=2, batch=1, val_prompts=0, eval_per_category=0, eval_humaneval=0,
                eagle_intermediate=32, train_vocab=128)
    return Recipe(**{**base, **kw})


def _run(model, recipe, out, **kw):
    kw.setdefault("log", lambda m: None)
    return train_head(model, recipe, out, progress=False, install_head=False, **kw)


def _keys(model, out, kind="eagle3"):
    layers = new_head(kind, model, _recipe([], kind=kind)).config.get("layers") or []
    return Shards(out, fingerprint(model), list(layers), keep_feats=kind != "eagle3", log=lambda m: None).keys()


def test_runs_add_up_new_data_only(tiny, tmp_path):
    model = tiny(seed=0)
    data = _prompts(tmp_path)
    out = tmp_path / "work"
    first = _run(model, _recipe([data]), out)
    keys1 = _keys(model, out)
    assert len(keys1) == 3 and first["data"]["sequences"] == 3 and first["steps"] == 2
    second = _run(model, _recipe([data]), out, resume=True)
    keys2 = _keys(model, out)
    assert keys1 < keys2 and len(keys2) == 6  # three new prompts, none made twice
    assert second["data"]["this_run"]["added_sequences"] == 3 and second["steps"] == 4
    assert len(list((out / "shards").glob("*.pt"))) == 2
    # what the shards hold is what the target computes for those sequences
    shards = Shards(out, fingerprint(model), list(second["config"]["layers"]), keep_feats=False, log=print)
    loaded = shards.load()
    ids = loaded.tokens[0].tolist()
    states: list = []
    _, labels = heads_data.sequence_features(model, ids, layers=list(second["config"]["layers"]), states=states)
    assert torch.equal(loaded.labels[0], labels) and loaded.feats[0] is None  # (EAGLE-3 keeps no final feature)
    assert torch.equal(loaded.layer_feats[0], states[0].to(torch.bfloat16))


def test_interrupted_extraction_keeps_full_shards(tiny, tmp_path, monkeypatch):
    model = tiny(seed=0)
    shards = Shards(tmp_path, fingerprint(model), [], keep_feats=True, log=lambda m: None)
    items, _, _ = plan(model, (str(_prompts(tmp_path)),), held=set(), max_prompts=5, text_chunks=0, seq_len=32, seed=0)
    monkeypatch.setattr(heads_data, "SHARD_TOKENS", 1)  # a shard per sequence
    real = heads_data.sequence_features
    calls = []

    def dies_on_the_fourth(*a, **kw):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(heads_data, "sequence_features", dies_on_the_fourth)
    with pytest.raises(KeyboardInterrupt):
        extract(model, items, shards, prompt_tokens=64, gen_tokens=4, seed=0, progress=lambda n, t: lambda: None)
    assert len(shards.keys()) == 3 and not list(shards.dir.glob("*.tmp*"))
    monkeypatch.setattr(heads_data, "sequence_features", real)
    rest = [it for it in items if it.key not in shards.keys()]
    assert [it.prompt for it in rest] == PROMPTS[3:5]
    extract(model, rest, shards, prompt_tokens=64, gen_tokens=4, seed=0, progress=lambda n, t: lambda: None)
    assert shards.keys() == {it.key for it in items}


def test_corrupt_shard_is_set_aside_and_made_again(tiny, tmp_path):
    model = tiny(seed=0)
    data = _prompts(tmp_path)
    out = tmp_path / "work"
    _run(model, _recipe([data], kind="medusa", max_prompts=2), out)
    shard = next((out / "shards").glob("*.pt"))
    shard.write_bytes(b"garbage" * 10)
    seen: list[str] = []
    again = _run(model, _recipe([data], kind="medusa", max_prompts=2), out, resume=True, log=seen.append)
    assert any("unreadable" in m and "set aside" in m for m in seen), seen
    assert (out / "shards" / (shard.name + ".corrupt")).exists()
    assert again["data"]["this_run"]["added_sequences"] == 2 and again["data"]["sequences"] == 2


def test_shards_of_other_weights_or_kind_are_refused(tiny, tmp_path):
    data = _prompts(tmp_path)
    out = tmp_path / "work"
    _run(tiny(seed=0), _recipe([data], kind="eagle3"), out)
    (out / CHECKPOINT).unlink()
    with pytest.raises(HeadMismatchError, match="other weights"):
        _run(tiny(seed=1), _recipe([data], kind="eagle3"), out)
    with pytest.raises(HeadMismatchError, match="other layers"):  # (an eagle head's shards keep features instead)
        _run(tiny(seed=0), _recipe([data], kind="eagle"), out)


def test_magpie_requests_are_new_each_run_and_reproducible(tiny, tmp_path):
    model = tiny(seed=0)
    assert heads_data.user_turn_opening(model)  # (the chat template's text before a user's request)
    items, _, _ = plan(model, ("magpie:2",), held=set(), max_prompts=0, text_chunks=0, seq_len=32, seed=7)
    assert [it.key for it in items] == ["magpie:7:0", "magpie:7:1"]
    later, _, _ = plan(model, ("magpie:2",), held={it.key for it in items}, max_prompts=0, text_chunks=0,
                       seq_len=32, seed=7)
    assert [it.key for it in later] == ["magpie:7:2", "magpie:7:3"]
    opening = heads_data.user_turn_opening(model)
    a = heads_data.make_sequence(model, items[0], opening=opening, prompt_tokens=64, gen_tokens=4, seed=7)
    b = heads_data.make_sequence(model, items[0], opening=opening, prompt_tokens=64, gen_tokens=4, seed=7)
    c = heads_data.make_sequence(model, items[1], opening=opening, prompt_tokens=64, gen_tokens=4, seed=7)
    assert a == b and a != c and a[1] > 0
    with pytest.raises(InvalidParameterError, match="magpie:N"):
        heads_data.check_sources(("magpie:0",))


def test_token_file_sequences_leave_out_the_held_apart(tiny, tmp_path):
    model = tiny(seed=0)
    seqs = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]]
    path = tmp_path / "tokens.npz"
    np.savez_compressed(path, tokens=np.array(sum(seqs, []), dtype=np.int32),
                        lengths=np.array([len(s) for s in seqs], dtype=np.int32), heldout=np.array([1], dtype=np.int32))
    assert heads_data.token_file_sequences(path) == [seqs[0], seqs[2]]
    out = tmp_path / "work"
    res = _run(model, _recipe([f"tokens:{path}"], kind="eagle", text_chunks=10), out)
    assert res["data"]["sequences"] == 2 and res["data"]["tokens"] == 9
    shards = Shards(out, fingerprint(model), [], keep_feats=True, log=print).load()
    assert sorted(t.tolist() for t in shards.tokens) == sorted([seqs[0], seqs[2]])
    bad = tmp_path / "bad.npz"
    np.savez_compressed(bad, tokens=np.arange(5, dtype=np.int32), lengths=np.array([9], dtype=np.int32))
    with pytest.raises(InvalidParameterError, match="add up"):
        heads_data.token_file_sequences(bad)


def test_init_resume_restart_rules(tiny, tmp_path):
    model = tiny(seed=0)
    data = _prompts(tmp_path)
    first = tmp_path / "first"
    _run(model, _recipe([data], kind="eagle3", steps=3), first)
    # --init: a new work directory starts from that head's weights (not random ones)
    init = new_head("eagle3", model, _recipe([data], init=str(first)))
    trained = Eagle3Head.from_config(json.loads((first / "manifest.json").read_text())["config"])
    from leapdecode.proposers.heads.store import load_head

    ref, _ = load_head("eagle3", model, first)
    assert all(torch.equal(a.float(), b.float()) for a, b in zip(init.state_dict().values(), ref.state_dict().values()))
    assert trained.config == init.config
    with pytest.raises(InvalidParameterError, match="fuses layers"):
        new_head("eagle3", model, _recipe([data], init=str(first), eagle_layers=(0, 1)))
    with pytest.raises(InvalidParameterError, match="choose one"):
        _run(model, _recipe([data], init=str(first)), first, resume=True)
    with pytest.raises(InvalidParameterError, match="no checkpoint"):
        _run(model, _recipe([data]), tmp_path / "empty", resume=True)
    # --restart deletes the checkpoint and the shards
    res = _run(model, _recipe([data], max_prompts=1), first, restart=True)
    assert res["steps"] == 2 and res["data"]["sequences"] == 1 and len(res["runs"]) == 1


def test_default_work_directory_is_in_the_model_cache(tiny, tmp_path):
    model = tiny(seed=0)
    d = default_workdir(model, "eagle3")
    assert d.parent == tmp_path / "cache" / "train" and d.name.endswith("-eagle3")
    res = train_head(model, _recipe([_prompts(tmp_path)], max_prompts=1), progress=False, install_head=False,
                     log=lambda m: None)
    assert res["path"] == str(d) and (d / CHECKPOINT).exists() and (d / "manifest.json").exists()


def test_accuracy_per_set_cached_and_rendered(tiny, tmp_path, monkeypatch):
    model = tiny(seed=0)
    out = tmp_path / "work"
    res = _run(model, _recipe([_prompts(tmp_path)], eval_per_category=1, eval_humaneval=2, eval_tokens=6), out)
    sets = res["accuracy"]["sets"]
    assert sets["humaneval held-apart"]["prompts"] == 2 and 0 < sets["humaneval held-apart"]["tokens"] <= 12
    spec = [k for k in sets if k.startswith("spec-bench/")]
    try:
        find_default_workload()
    except WorkloadError:  # (a checkout without shared/data beside it: said, and HumanEval alone)
        assert not spec and "Spec-Bench dev not scored" in res["accuracy"]["notes"][0]
    else:
        assert len(spec) >= 10, sets.keys()  # one prompt of each Spec-Bench dev category (shared/data)
        assert sets["spec-bench dev"]["tokens"] == sum(sets[k]["tokens"] for k in spec)
    assert json.loads((out / "accuracy.json").read_text())["sets"] == sets
    assert res["runs"][-1]["top1"] == {k: v["top1"] for k, v in sets.items()
                                       if k in ("spec-bench dev", "humaneval held-apart")}
    # the scores are chain_hits' over the cached sequences: a second scoring does not generate
    from leapdecode import api

    monkeypatch.setattr(api, "generate", lambda *a, **k: pytest.fail("generated again"))
    head = new_head("eagle3", model, _recipe([], init=str(out)))
    again = heads_eval.accuracy(model, head, per_category=1, humaneval=2, tokens=6)
    assert again["sets"] == sets
    # each set's figure is the hits of its sequences' chains over their generated rows, added up
    qs, _ = heads_eval.eval_questions(1, 2)
    seqs = heads_eval.eval_sequences(model, list(head.config["layers"]), qs, 6)  # (from the cache)
    weight = model.model.head_weight.detach().float()
    hits = [0, 0, 0]
    rows = 0
    for s in seqs["humaneval held-apart"]:
        ids = s["ids"].long()
        emb = model.model.embed(ids).float()
        emb = torch.cat([emb, emb.new_zeros(3, emb.shape[-1])])
        with torch.no_grad():
            got = heads_eval.chain_hits(head.float(), head.fuse_states(s["states"].float()[: len(ids) - 1]), emb,
                                        s["labels"].long(), weight, 3, skip=s["prompt_len"] - 1)
        hits = [h + g[0] for h, g in zip(hits, got)]
        rows += got[0][1]
    assert rows == sets["humaneval held-apart"]["tokens"]
    assert [round(h / rows, 4) for h in hits][0] == sets["humaneval held-apart"]["top1"][0]


def test_heads_accuracy_cli_and_results_page(tiny, tmp_path, capsys):
    out = tmp_path / "work"
    _run(tiny(seed=0), _recipe([_prompts(tmp_path)]), out)
    saved = tmp_path / "results" / "heads" / "r.json"
    saved.parent.mkdir(parents=True)
    rc = cli_main(["heads", "accuracy", "-m", "tiny-random:0", "--dtype", "fp32", "--head", str(out),
                   "--per-category", "0", "--humaneval", "1", "--tokens", "5", "--save", str(saved)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "humaneval held-apart (1 prompts, 5 tokens)" in printed
    report = json.loads(saved.read_text())
    assert report["report"] == "head-accuracy" and report["model"] == "tiny-random:0"
    assert read_head_reports(saved.parent) == [report]
    page = "\n".join(heads_section([report]))
    assert "## Draft heads" in page and "tiny-random:0" in page and report["command"] in page
    assert head_table({"a": {"x": {"top1": [0.5, None, 0.25], "tokens": 4, "prompts": 1}}})[-1] == \
        "| x (1 prompts, 4 tokens) | 0.500 / - / 0.250 |"
    assert cli_main(["heads", "accuracy", "-m", "tiny-random:0", "--per-category", "0", "--humaneval", "0"]) == 2
    (saved.parent / "bad.json").write_text("{}")
    with pytest.raises(InvalidParameterError, match="not a head-accuracy report"):
        read_head_reports(saved.parent)


def test_cli_refuses_bad_sources_before_loading(tmp_path, capsys):
    assert cli_main(["train-head", "-m", "no-such-model", "--kind", "eagle3", "--data", "magpie:x"]) == 2
    assert "magpie:N" in capsys.readouterr().err
    assert cli_main(["train-head", "-m", "no-such-model", "--kind", "eagle3", "--data", f"tokens:{tmp_path}/x.npz"]) == 2
    assert "no such file" in capsys.readouterr().err
    assert cli_main(["train-head", "-m", "no-such-model", "--kind", "eagle3", "--resume", "--restart"]) == 2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_train_head_where_the_target_runs_on_a_gpu(tmp_path):
    """The same train-head on a GPU (scripts/gpu_check.py runs it when a GPU is lent): shards,
    training and scoring with the target and the head on CUDA."""
    from leapdecode.models.tiny import tiny_loaded

    model = tiny_loaded(seed=0, device="cuda")
    res = _run(model, _recipe([_prompts(tmp_path)], eval_humaneval=1, eval_tokens=4), tmp_path / "work")
    assert res["steps"] == 2 and res["runs"][-1]["device"].startswith("cuda")
    assert len(res["accuracy"]["sets"]["humaneval held-apart"]["top1"]) == 3
