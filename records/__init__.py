"""What a run records, and where: the run directory's layout and writers (run_dir.py), the JSONL
files (jsonl.py), the node rows of a round, flat and tree (rows.py), a round's summary,
transcript and tree renderings (render.py), and a code-exec script's typed execution result
(exec_result.py), which the grader returns and every layer passes on whole.

Plain data and files only (no Ray, gRPC, torch or pydantic), imported by graders/ (the execution
result), search/ (tree rows), evals/ (reading runs) and services/ (writing them); it imports
nothing of ours."""
