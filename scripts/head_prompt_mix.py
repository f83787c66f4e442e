"""A broad offline prompt mix for self-distilling a draft head on a GPU (`scripts/head_gpu.py`).

Every prompt comes from text that installs with Python or from installed packages, so the mix is
rebuilt the same anywhere (fixed seed):

- chat prompts over the Python documentation's topics (`head_chat_prompts.paragraphs`), each
  paragraph with two instruction templates (summarise, explain, translate, questions and answers,
  rewrite, code example, ...); the translation prompts carry a follow-up (`"then"`): the target's
  own German or French answer is asked back into English in a second round, so the head also sees
  translation *into* English without any foreign-language data;
- coding prompts from the standard library's public functions (signature and docstring, parsed
  with `ast`, nothing imported): "write this function", "explain this code", "write tests";
- arithmetic word problems from templates with random names and numbers, asked step by step;
- HumanEval's prompts, except the held-apart ones (`bench.workloads.held_apart`), as plain
  completions and as chat requests;
- general chat over everyday and academic topics (a list written here, not drawn from any
  benchmark): writing, role play, reasoning, explanation and short questions, plus two-round
  tasks whose source text the target writes itself in the first round (a German paragraph then
  translated into English, a news-style report then summarised, a text then mined for names,
  dates and numbers).

`head_gpu.py` adds Magpie-style prompts written by the target itself. Nothing here is drawn from
Spec-Bench or from HumanEval's held-apart problems, on which acceptance is reported.

    python scripts/head_prompt_mix.py --out .gpu/prompts.jsonl.gz
"""

from __future__ import annotations

import argparse
import ast
import gzip
import json
import os
import random
import sys
import sysconfig
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from head_chat_prompts import TEMPLATES, paragraphs  # noqa: E402

BACK = {
    "German": "Translate the following German text into English.\n\n{a}",
    "French": "Translate this French passage to English, keeping its meaning and tone.\n\n{a}",
}

CODE_TEMPLATES = [
    "Write a Python function `{sig}` that does the following:\n\n{doc}",
    "Implement `{sig}` in Python.\n\nSpecification:\n{doc}\n\nInclude a short docstring and an example call.",
    "Here is the documentation of a Python function:\n\n{sig}\n{doc}\n\nWrite unit tests for it with pytest.",
    "Explain what a function with this documentation is for, and when you would use it:\n\n{sig}\n{doc}",
]

NAMES = ["Ava", "Ben", "Carla", "Diego", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jamal", "Kofi", "Lena",
         "Mateo", "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tariq"]
ITEMS = ["apples", "books", "stickers", "marbles", "pencils", "cookies", "stamps", "shells", "cards", "eggs"]


TOPICS = [
    "photosynthesis", "the French Revolution", "household budgeting", "climate change", "the stock market",
    "sleep", "job interviews", "learning a new language", "the water cycle", "black holes", "vaccines",
    "the Roman Empire", "healthy breakfasts", "time management", "electric cars", "volcanoes",
    "the immune system", "solar power", "a wedding toast", "a week in Japan", "remote work", "chess",
    "the printing press", "honey bees", "inflation", "marathon training", "urban gardening", "jazz",
    "the Moon landing", "plate tectonics", "social media and teenagers", "recycling", "the Renaissance",
    "antibiotics", "coffee", "public libraries", "earthquakes", "the human heart", "meditation",
    "the Silk Road", "3D printing", "rainforests", "a small bakery", "interest rates", "dinosaurs",
    "the Olympic Games", "football tactics", "opera", "nuclear fusion", "ancient Egypt", "wind turbines",
    "starting a podcast", "adopting a dog", "first aid", "the Great Depression", "quantum computers",
    "coral reefs", "a road trip across Canada", "impressionist painting", "the Internet's history",
    "minimum wage", "composting", "migratory birds", "the Cold War", "smartphones and attention",
    "a science fair project", "volunteering", "tea ceremonies", "mountain climbing", "supply chains",
    "the periodic table", "democracy in ancient Athens", "city traffic", "fast fashion", "sourdough bread",
    "the solar system", "a mystery novel", "negotiating a salary", "friendship", "the Industrial Revolution",
]
GENERAL = [
    "Write a short blog post about {t}.",
    "Compose a short poem about {t}.",
    "Write a friendly email to a colleague that mentions {t}.",
    "Act as a teacher and explain {t} to a curious twelve-year-old.",
    "Pretend you are a tour guide or an expert on {t}. Greet a visitor and tell them what matters most.",
    "What are the main arguments for and against {t}? Reason step by step, then conclude.",
    "Explain {t} in detail.",
    "Give five surprising facts about {t}.",
    "Answer briefly: why does {t} matter?",
    "What is the history of {t}, in a few paragraphs?",
    "What are common misconceptions about {t}?",
]
TWO_ROUND = [
    ("Write a short paragraph about {t} in German.", "Translate the following German text into English.\n\n{a}"),
    ("Write a short news report about a recent event involving {t}.",
     "Summarize the following article in three sentences.\n\n{a}"),
    ("Write a short text about {t} that mentions several people, places, dates and numbers.",
     "Extract every name, place, date and number from the text below as a JSON object.\n\n{a}"),
]


def general_items(rng: random.Random, n: int) -> list[dict]:
    """Up to ``n`` distinct general chat prompts (topics x templates, the two-round tasks among them),
    a seeded sample of all the combinations."""
    combos = [{"chat": g.format(t=t)} for t in TOPICS for g in GENERAL]
    combos += [{"chat": first.format(t=t), "then": then} for t in TOPICS for first, then in TWO_ROUND]
    return rng.sample(combos, min(n, len(combos)))


def math_problem(rng: random.Random) -> str:
    n, m = rng.sample(NAMES, 2)
    it = rng.choice(ITEMS)
    a, b, c = rng.randint(3, 60), rng.randint(2, 12), rng.randint(2, 9)
    price, pct, hours = rng.randint(2, 40), rng.choice([10, 15, 20, 25, 30, 40, 50]), rng.randint(2, 10)
    problems = [
        f"{n} has {a} {it}. {n} buys {b} packs with {c} {it} each, then gives {m} a third of all the {it}, "
        f"rounded down. How many {it} does {n} have left?",
        f"A shop sells {it} for ${price} each. {n} buys {b} of them and pays with a ${price * b + a} bill. "
        f"How much change does {n} get?",
        f"{n} reads {a} pages a day for {b} days, then {c} more pages each day for the next {hours} days. "
        f"How many pages did {n} read in total?",
        f"A jacket costs ${price * 10}. It is on sale for {pct}% off, and {n} pays {c}% sales tax on the sale "
        f"price. What does {n} pay?",
        f"{n} and {m} share {a * c} {it} in the ratio {b}:{c}. How many {it} does each get?",
        f"A train travels {a * 5} km in {hours} hours. At the same speed, how long does it take to travel "
        f"{a * 5 + b * 10} km?",
        f"{n} earns ${price} an hour and works {hours} hours a day, {c} days a week. How much does {n} earn in "
        f"{b} weeks, and how much is left after spending {pct}% of it?",
        f"The sum of two numbers is {a + b * 7} and their difference is {abs(a - b * 7)}. What are the numbers?",
        f"A rectangle is {a} cm long and {b + c} cm wide. A square has the same perimeter. What is the area of "
        f"the square?",
        f"{n} saves ${b} in the first week and ${c} more each week than the week before. How much has {n} saved "
        f"after {hours} weeks?",
    ]
    ask = rng.choice(["Solve step by step.", "Show your reasoning, then give the final answer.",
                      "Explain each step of the calculation.", ""])
    return f"{rng.choice(problems)} {ask}".strip()


def stdlib_functions(limit_files: int = 400) -> list[tuple[str, str]]:
    """(signature, first docstring paragraph) of public module-level functions of the stdlib."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    files = sorted(p for p in root.glob("*.py") if not p.name.startswith("_"))
    files += sorted(p for p in root.glob("*/*.py") if not any(s.startswith(("_", "test", "idlelib", "lib2to3"))
                                                            for s in p.relative_to(root).parts))
    for path in files[:limit_files]:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 60:
                    sig = f"{node.name}({ast.unparse(node.args)})"
                    out.append((sig, doc.split("\n\n")[0].strip()[:600]))
    return out


def humaneval_items() -> list[dict]:
    from leapdecode.bench.workloads import held_apart
    from leapdecode.training.data import humaneval_prompts

    out = []
    for i, p in enumerate(humaneval_prompts()):
        if held_apart(i):
            continue
        out.append({"prompt": p})
        out.append({"chat": f"Complete the following Python function.\n\n```python\n{p}```"})
    return out


def build(seed: int, math_n: int, code_n: int, general_n: int = 0, docs_n: int | None = None,
          humaneval: bool = True) -> list[dict]:
    rng = random.Random(seed)
    items: list[dict] = []
    for i, p in enumerate(paragraphs()[:docs_n]):
        for t in rng.sample(range(len(TEMPLATES)), 2):
            tpl = TEMPLATES[t]
            item = {"chat": tpl.format(p=p)}
            lang = next((k for k in BACK if f"into {k}" in tpl), None)
            if lang:
                item["then"] = BACK[lang]
            items.append(item)
    funcs = stdlib_functions()
    rng.shuffle(funcs)
    for i, (sig, doc) in enumerate(funcs[:code_n]):
        items.append({"chat": CODE_TEMPLATES[i % len(CODE_TEMPLATES)].format(sig=sig, doc=doc)})
    items += [{"chat": math_problem(rng)} for _ in range(math_n)]
    if humaneval:
        items += humaneval_items()
    items += general_items(rng, general_n)
    rng.shuffle(items)
    return items


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="gzipped JSONL of prompts")
    ap.add_argument("--math", type=int, default=600, help="arithmetic word problems (default: %(default)s)")
    ap.add_argument("--code", type=int, default=1200, help="stdlib function prompts (default: %(default)s)")
    ap.add_argument("--docs", type=int, default=None,
                    help="documentation paragraphs, two prompts each (default: all of them)")
    ap.add_argument("--no-humaneval", action="store_true", help="leave out HumanEval's (trained-on) prompts")
    ap.add_argument("--general", type=int, default=0,
                    help="general chat prompts over everyday topics, at most one per topic and template "
                         "(1,120 combinations; default: %(default)s, the bundled head's run had none)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    items = build(a.seed, a.math, a.code, a.general, a.docs, not a.no_humaneval)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = a.out.with_name(a.out.name + ".tmp")
    with gzip.open(tmp, "wt", encoding="utf-8") as f:
        for it in items:
            f.write(json.dumps(it) + "\n")
    os.replace(tmp, a.out)
    kinds = {"chat": sum("chat" in i for i in items), "prompt": sum("prompt" in i for i in items),
             "then": sum("then" in i for i in items)}
    print(f"{len(items)} prompts ({kinds}) -> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
