"""The results page, docs/results.md, and the README's headline, generated from committed reports:
``leapdecode bench`` summaries and the reports of the measuring scripts (``page.py``, ``leapdecode
results``), with the scale section and its projection (``scale.py``).  It reads what the bench and the
scripts wrote; nothing in ``bench/`` imports it."""
