"""Students' notebooks stop at their first blank (NotImplementedError) by design, so nbval must not
collect them; tests/test_exercises.py executes them instead. The solution notebooks run under nbval."""

collect_ignore_glob = ["student/*.ipynb"]
