"""Code-execution grader: ML-engineering tasks graded by running the policy's script.

Plain modules, no Ray or gRPC: `task`/`build` (tasks in the MLE-bench layout, the bundled ones
built offline), `extract` (code from a completion), `sandbox` (isolated execution), `grading`
(checks, metrics, rewards), `verifier` (CodeExecTask: cases/score), `ladder` (reference scripts,
the yardstick), `service` (the registered `code-exec` grader task: CodeExecTask as the grader
service's records). Settings: config/code_exec.py, the `grader.code_exec` section.
"""
