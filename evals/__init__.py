"""Evaluation analysis over EVAL.jsonl files: the file format (records), held-out pass rate and
its paired before/after interval (heldout), arm-vs-base comparisons with bootstrap intervals
(compare), the prior shape of a model's openings (prior_shape), the five-options probe's parsing
(probe), their figures, and the file-based CLI commands (commands).

Pure analysis: nothing here starts Ray, a grader or a rollout replica, and nothing here imports
services/ (the driver imports this package, never the reverse). Running an eval against the
services is services/eval_run.py.
"""
