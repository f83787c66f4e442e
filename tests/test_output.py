"""The output processor (``core/output.py``) and a task's status (``core/task.Status``)."""

from __future__ import annotations

import leapdecode
from leapdecode import ModelRunner
from leapdecode.core.output import OutputProcessor
from leapdecode.core.task import Status
from leapdecode.models.tiny import byte_tokenizer


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_a_stop_string_is_held_back_until_it_cannot_start_one():
    tok = byte_tokenizer()
    out = OutputProcessor(tok, ["END"])
    shown = out.emit(_ids(tok, "hello E"), None)
    assert (shown.piece, shown.finish, shown.covering) == ("hello ", None, None)  # "E" may start "END"
    shown = out.emit(_ids(tok, "x"), None)
    assert shown.piece == "Ex" and shown.text == "hello Ex"
    shown = out.emit(_ids(tok, " EN"), None)
    assert shown.piece == " "
    shown = out.emit(_ids(tok, "D and more"), None)
    assert (shown.piece, shown.text, shown.finish) == ("", "hello Ex ", "stop")
    assert tok.decode(shown.covering).startswith("hello Ex ")  # the tokens whose text covers the output


def test_the_end_flushes_what_was_held_back_and_counts_the_steps():
    tok = byte_tokenizer()
    out = OutputProcessor(tok, ["END"])
    assert out.emit(_ids(tok, "ab E"), None).piece == "ab "
    assert out.emit([], "length").piece == "E"  # the limit: nothing can start a stop string any more
    out.count_step(4, 2)
    out.count_step(0, 0)
    out.decided = 4
    stats = out.stats(method="pld", new_tokens=4, prompt_tokens=3, wall=2.0, prefill_s=0.5, prefix_reused=0,
                      constrained=False)
    assert (stats["target_forwards"], stats["tree_rows"], stats["mean_accepted"]) == (2, 4, 2.0)
    assert stats["accept_hist"] == {"0": 1, "2": 1} and stats["tokens_per_s"] == 2.0
    assert "constraint_s" not in stats
    assert out.draft_acceptance() == (2 + 2.0) / (1 + 2.0)


def test_a_generation_goes_through_its_statuses(tiny):
    runner = ModelRunner(tiny())
    gen = leapdecode.start_generation(runner, "hello there, this is a prompt", max_new_tokens=3, method="vanilla")
    assert gen.status is Status.WAITING
    seen = []
    while not gen.done:
        out = gen.next_forwards()
        seen.append(gen.status)
        if not isinstance(out, list):
            continue
        gen.finish_forwards(out, [f.run() for f in out])
    assert gen.status is Status.FINISHED and seen[0] is Status.PREFILLING and Status.DECODING in seen
    beam = leapdecode.start_generation(runner, "hello", max_new_tokens=2, strategy="beam", num_beams=2)
    assert beam.status is Status.WAITING
    beam.step()
    assert beam.status is Status.DECODING
    beam.run()
    assert beam.status is Status.FINISHED and runner.caches_in_use == 0
