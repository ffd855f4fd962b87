"""``python -m bft_lightning tune``: hyperparameter search over ``fit`` runs, with Optuna.

- :mod:`.space`: the search-space YAML (option paths, distributions, conditions).
- :mod:`.study`: storage, sampler, pruner and the loop that spends the trial budget.
- :mod:`.trial`: one trial, a ``fit`` run through the ``fit`` command's own CLI.
- :mod:`.stopping`: SIGTERM and Ctrl+C as one orderly stop, and a stopped or failed
  trial's exceptions.
- :mod:`.report`: progress lines, the trials table and the plots.
- :mod:`.cli`: the command line.

Optuna is an optional dependency (``pip install 'bft-lightning[tune]'``); only
:mod:`.space` imports without it.
"""
