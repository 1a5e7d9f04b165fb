"""Hyper-parameter sweeps: many train.py runs as the trials of one Optuna study (docs/sweeps.md).

  spec.py    the sweep file: recipe, search space, metric, budget, pruner; checked in one pass before anything runs
  study.py   Optuna's study, and the worker that runs trials as run directories, prunes through STOP files, and
             adopts the trials of a worker that died
  report.py  the table, the best trial's command, the plot
"""
