"""lm-evaluation-harness on jax3d: the model (model.py), requests packed into rows (rows.py) and
tasks from local files (offline_tasks.py). `python -m jax3d.eval` and `eval.tasks` in training use it."""
