"""``leapdecode diffusion generate|methods`` (issue 18): output, JSON, typed errors (exit 2)."""

import json

from leapdecode.cli import main
from leapdecode.diffusion import generate


def test_generate_json_matches_the_api(capsys):
    rc = main(["diffusion", "generate", "-m", "tiny-dream:1", "--method", "ssd", "--option", "max_draft=3",
               "--max-new-tokens", "10", "--block-size", "5", "--json", "Hello"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    ref = generate("tiny-dream:1", "Hello", method="stepwise", max_new_tokens=10, block_size=5)
    assert out["tokens"] == ref.tokens and out["text"] == ref.text
    assert out["stats"]["method"] == "ssd" and out["stats"]["forwards"] <= 10


def test_plain_text_and_stats(capsys):
    assert main(["diffusion", "generate", "-m", "tiny-llada", "--max-new-tokens", "4", "--block-size", "4",
                 "--stats", "x"]) == 0
    captured = capsys.readouterr()
    assert "forwards=4" in captured.err and "method=stepwise" in captured.err


def test_typed_errors_exit_2(capsys):
    assert main(["diffusion", "generate", "-m", "tiny-llada", "--method", "draft", "x"]) == 2
    assert "causal-LM" in capsys.readouterr().err
    assert main(["diffusion", "generate", "-m", "tiny-llada", "--method", "ssd", "--option", "nope=1", "x"]) == 2
    assert "no option 'nope'" in capsys.readouterr().err
    assert main(["diffusion", "generate", "-m", "smollm2-135m", "x"]) == 2
    assert "causal LM" in capsys.readouterr().err
    assert main(["diffusion", "generate", "-m", "/nonexistent/dir", "x"]) == 2


def test_methods_lists_every_method_and_option(capsys):
    from leapdecode.diffusion import DIFFUSION_METHODS

    assert main(["diffusion", "methods", "--markdown"]) == 0
    md = capsys.readouterr().out
    for name, spec in DIFFUSION_METHODS.items():
        assert f"### `{name}` options" in md
        for opt in spec.config.option_names():
            assert f"| `{opt}` |" in md


def test_docs_option_tables_are_the_configs():
    from pathlib import Path

    from leapdecode.diffusion_cli import methods_markdown

    text = (Path(__file__).resolve().parents[1] / "docs" / "diffusion.md").read_text()
    begin, end = "<!-- diffusion-options:begin -->\n", "\n<!-- diffusion-options:end -->"
    assert begin in text and end in text, "docs/diffusion.md lost its generated options section"
    section = text[text.index(begin) + len(begin) : text.index(end)]
    assert section.strip() == methods_markdown().strip(), (
        "docs/diffusion.md's option tables differ from the configs: regenerate them with "
        "`leapdecode diffusion methods --markdown`")
