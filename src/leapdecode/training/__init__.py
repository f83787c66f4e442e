"""Draft heads' training (``leapdecode train-head``, ``leapdecode heads``; docs/heads.md): the data
as shards that add up across runs (``data.py``: self-distilled and Magpie-style requests answered by
the target, token files, the target's features), the losses and the resumable training loop
(``train.py``), the teacher-forced accuracy per Spec-Bench category after every run
(``accuracy.py``), and the command lines (``cli.py``).

The heads themselves, their proposers and their store are in ``proposers/heads/``.  Training sits
here, beside the front ends, because it stands on them: it generates the target's own answers
through the API (self-distillation) and scores on the bench's workloads, and a module under
``proposers/`` may import neither.
"""
