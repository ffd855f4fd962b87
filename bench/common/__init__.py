"""What the benchmark scripts share, each once.

- ``runs``: run records: the one-JSON-per-run folders of the language-model
  experiments, and the recommendation runs' folders, their archive in
  ``results/rec/runs/`` and the loading of both;
- ``tables``: ``results/rec/summary.json`` (its rows, from every table) and the
  name of a tuned comparison's table;
- ``paired``: a mean with its standard error, and paired differences with theirs;
- ``pretrain``: the language model's pre-training loop and its trainer;
- ``hardware``: the notes on the machine and software a result was measured on.

A script runs as ``python bench/<script>.py``, so ``bench/`` is on the path and this
package imports as ``common``; each script that uses it also puts its own folder on
the path, so that it imports the same way when a test loads it from its file.
Importing a module here stays light (``pretrain`` aside): the scale benchmarks'
child processes measure their own memory.
"""
