"""One source per option (issue 48, item 4): every method option's default is written once, in its
config (proposers/configs.py); proposer constructors take theirs from the config's fields, the tree
budget drafted when none is set is the config's ``default_tree_budget``, and ``leapdecode methods``
shows every default, ``tree_budget``'s included.  Checked on the source with ``ast``."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap

import pytest

from leapdecode.cli import main as cli_main
from leapdecode.proposers import configs
from leapdecode.proposers.registry import METHODS
from leapdecode.proposers.auto import AutoProposer
from leapdecode.proposers.draft_model import DraftModelProposer
from leapdecode.proposers.heads.eagle import EagleProposer
from leapdecode.proposers.heads.hydra import HydraProposer
from leapdecode.proposers.heads.medusa import MedusaProposer
from leapdecode.proposers.jacobi import JacobiProposer
from leapdecode.proposers.layerskip import LayerSkipProposer
from leapdecode.proposers.lookahead import LookaheadProposer
from leapdecode.proposers.pld import PromptLookupProposer
from leapdecode.proposers.recycling import TokenRecyclingProposer
from leapdecode.proposers.rest import RestProposer
from leapdecode.proposers.sam import MATCH_BUCKETS, SuffixAutomatonProposer
from leapdecode.proposers.suffix import SuffixDecodingProposer
from leapdecode.proposers.universal_draft import UniversalDraftProposer

PROPOSERS = {  # proposer -> the config whose options it takes
    AutoProposer: configs.AutoConfig, DraftModelProposer: configs.DraftConfig,
    UniversalDraftProposer: configs.DraftConfig, PromptLookupProposer: configs.PldConfig,
    SuffixAutomatonProposer: configs.SamConfig, SuffixDecodingProposer: configs.SuffixConfig,
    TokenRecyclingProposer: configs.RecyclingConfig, LookaheadProposer: configs.LookaheadConfig,
    JacobiProposer: configs.JacobiConfig, RestProposer: configs.RestConfig, LayerSkipProposer: configs.LayerSkipConfig,
    MedusaProposer: configs.MedusaConfig, HydraProposer: configs.HydraConfig, EagleProposer: configs.EagleConfig,
}


def _init_defaults(cls) -> dict[str, ast.expr]:
    """The default expression of every parameter of ``cls.__init__`` that has one."""
    fn = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__))).body[0]
    args = fn.args.args[-len(fn.args.defaults):] if fn.args.defaults else []
    out = {a.arg: d for a, d in zip(args, fn.args.defaults)}
    out.update({a.arg: d for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults) if d is not None})
    return out


@pytest.mark.parametrize("proposer", list(PROPOSERS), ids=lambda c: c.__name__)
def test_a_proposer_takes_its_defaults_from_its_config(proposer):
    config = PROPOSERS[proposer]
    fields = {f.name for f in dataclasses.fields(config)} - {"tree_budget"}
    defaults = _init_defaults(proposer)
    shared = fields & set(defaults)
    assert shared, f"{proposer.__name__} shares no option with {config.__name__}"
    for name in sorted(shared):
        d = defaults[name]
        written = ast.unparse(d)
        assert isinstance(d, ast.Attribute) and written == f"{config.__name__}.{name}", \
            f"{proposer.__name__}({name}={written}): a default written again; use {config.__name__}.{name}"


def _literal_budget_fallbacks(tree: ast.AST) -> list[str]:
    """``tree_budget or 24`` and the like: a number written where the config's default belongs."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or):
            names = [v for v in node.values if isinstance(v, ast.Name) and v.id == "tree_budget"]
            consts = [v for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, int)]
            if names and consts:
                found.append(ast.unparse(node))
        if isinstance(node, ast.IfExp) and isinstance(node.orelse, ast.Constant) and "tree_budget" in ast.unparse(node.test):
            found.append(ast.unparse(node))
    return found


@pytest.mark.parametrize("proposer", list(PROPOSERS), ids=lambda c: c.__name__)
def test_no_tree_budget_default_is_written_in_a_proposer(proposer):
    tree = ast.parse(textwrap.dedent(inspect.getsource(proposer.__init__)))
    assert _literal_budget_fallbacks(tree) == []


def test_the_check_finds_a_planted_default():
    planted = ast.parse("def __init__(self, tree_budget=None, k=3):\n    self.b = tree_budget or 24\n")
    assert _literal_budget_fallbacks(planted) == ["tree_budget or 24"]

    class Planted:
        def __init__(self, max_ngram: int = 4) -> None:
            pass

    assert ast.unparse(_init_defaults(Planted)["max_ngram"]) == "4"  # (which the test above refuses)


def test_every_method_shows_its_tree_budget_default(capsys):
    for name, spec in METHODS.items():
        row = next(r for r in spec.config.options_table() if r[0] == "tree_budget")
        assert row[1] not in ("None", ""), (name, row)
    assert configs.PldConfig.tree_budget_default_text() == "24"
    assert "another tokenizer: 16" in configs.DraftConfig.tree_budget_default_text()
    assert cli_main(["methods", "--markdown"]) == 0
    out = capsys.readouterr().out
    assert "| `tree_budget` | `(guesses + window) x (ngram - 1)` |" in out


def test_the_defaults_proposers_use_are_the_configs():
    assert PromptLookupProposer().default_budget == configs.PldConfig.default_tree_budget
    assert SuffixDecodingProposer().default_budget == configs.SuffixConfig.default_tree_budget
    assert TokenRecyclingProposer().default_budget == configs.RecyclingConfig.default_tree_budget
    assert JacobiProposer(k=5).default_budget == 5
    p = PromptLookupProposer()
    assert (p.max_ngram, p.draft_len) == (configs.PldConfig.max_ngram, configs.PldConfig.draft_len)
    assert configs.AutoConfig.sam_only_match == MATCH_BUCKETS[3]  # (auto's match buckets' top boundary)
