"""Whole-model training stages (``distill``): the student in its compressed layout (``student``), the
objectives (``losses``; maths in :mod:`moecompress.methods.distill`), the loop (``loop``), writing the
trained checkpoint in the same layouts (``write``) and the stage end to end (``stage``).
See ``docs/training.md``."""
