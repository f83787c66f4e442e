"""The prefill planner (``core/prefill.py``): one implementation of the prompt's way through the
runner's prefix cache, for generations and searches alike."""

from __future__ import annotations

import leapdecode
from leapdecode import ModelRunner
from leapdecode.core.prefill import PrefillPlanner


def _walk(planner: PrefillPlanner, decoder, cache) -> list[int]:
    """Run the planner's forwards; the tokens each computed."""
    sizes = []
    while (f := planner.next_forward(0)) is not None:
        decoder.forward(f.tokens[None], cache, logits_for=slice(0, 0))
        cache.commit()
        planner.computed(f)
        sizes.append(f.tokens.numel())
    return sizes


def test_a_second_prefill_of_a_prompt_restores_what_the_first_kept(tiny):
    model = tiny()
    runner = ModelRunner(model)
    ids = model.tokenizer.encode("The cat sat on the mat, and the dog sat on the log. " * 8)
    leapdecode.generate(runner, prompt_ids=ids, max_new_tokens=2, method="vanilla")  # keeps the prompt's blocks
    cache = runner.acquire_cache(model, len(ids) + 8)
    try:
        planner = PrefillPlanner(runner, cache, ids)
        computed = _walk(planner, model.model, cache)
        assert planner.done and planner.prefilled == len(ids) - 1 == cache.length
        assert planner.reused > 0 and sum(computed) == len(ids) - 1 - planner.reused
    finally:
        runner.release_cache(cache)
    cache = runner.acquire_cache(model, len(ids) + 8)
    try:  # restore=False: every chunk computed (a caller wants their hidden states), none restored
        planner = PrefillPlanner(runner, cache, ids, restore=False)
        assert sum(_walk(planner, model.model, cache)) == len(ids) - 1 and planner.reused == 0
    finally:
        runner.release_cache(cache)


def test_a_search_restores_a_generations_prompt_and_gives_the_same_hypotheses(tiny):
    model = tiny()
    ids = model.tokenizer.encode("Once upon a time there was a small cat who lived in a big house. " * 6)
    cold = leapdecode.generate(ModelRunner(model), prompt_ids=ids, strategy="beam", num_beams=2, max_new_tokens=4)
    runner = ModelRunner(model)
    leapdecode.generate(runner, prompt_ids=ids, max_new_tokens=1, method="vanilla")
    warm = leapdecode.generate(runner, prompt_ids=ids, strategy="beam", num_beams=2, max_new_tokens=4)
    assert warm.stats["prefix_reused"] > 0 and cold.stats["prefix_reused"] == 0
    assert [h.tokens for h in warm.hypotheses] == [h.tokens for h in cold.hypotheses]
