"""Experiments that launch runs: ``compare`` (algorithms x seeds), ``sweep`` (settings'
grid), ``tune`` (Optuna studies over ``search_space``), all through ``runs`` (many runs
into one folder, resumable). Tables and plots of finished runs are in ``edgepfl.report``."""
