"""Constrained decoding: the output follows a structure.  ``grammar.py`` compiles JSON schemas,
regexes and grammars (Lark, GBNF) into ``core.constraint.Constraint`` objects on llguidance;
``asap.py`` samples exactly from the model's distribution conditioned on a grammar (ASAp).  The
generation loop only knows the ``Constraint`` interface; this package implements it."""
