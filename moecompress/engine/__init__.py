"""The recipe engine: recipes, the chained dry run, calibration, plans and the one streaming loop.

Modules: ``spec`` (what a pass is), ``recipe`` (YAML -> steps), ``context`` (the run's dtype, device,
seed, progress), ``dry_run`` (shapes-only checks of the whole chain), ``executor`` (``apply``),
``steps`` (one step on one layer: its statistics view and the protection contract), ``layer_loop``
(the streaming loop behind ``apply`` and ``rewrite_checkpoint``), ``run`` (a recipe's writers, reports
and journal), ``journal`` (``--resume``), ``protection`` (the super-expert contract).
"""
