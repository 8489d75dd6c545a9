"""bench: the harness (CLI, model and data loading, evaluation, runner, results store, reports)."""
