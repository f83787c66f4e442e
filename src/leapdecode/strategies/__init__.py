"""Decoding strategies above the generation loop: constrained decoding (``grammar``), and search,
sampling and test-time scaling strategies."""
