"""scripts/gpu_check.py, the prepared GPU check (issue 47), end to end on a tiny model on the CPU
(``--tiny``: the padded static step instead of CUDA graphs), so that the script a lent GPU runs
cannot rot between GPU sessions."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_runs_every_section_on_a_tiny_model(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    res = gpu_check.main(["--out", str(tmp_path), "--tiny", "--device", "cpu", "--tokens", "12",
                          "--identity-tokens", "16", "--reps", "3"])
    assert not [k for k, v in res.items() if isinstance(v, dict) and "error" in v]
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert saved["vanilla"]["padded"]["decode_tokens_per_s"] > 0
    assert set(saved["verify"]["padded"]["vs_one_row"]) >= {"1", "16", "64"}
    assert saved["invariance"]["padded"]["all_equal"] is True
    configs = {k: v for k, v in saved["identity"].items() if k != "section_s"}
    assert set(configs) == {"eager", "padded", "padded-buckets"}
    for entry in configs.values():
        for e in entry.values():
            assert e["identical"] == e["prompts"] == 2
    table = (tmp_path / "gpu_check.md").read_text()
    assert "leapdecode padded" in table and "| 16 |" in table and "identical to vanilla" in table
