"""Code-execution grader: ML-engineering tasks graded by running the policy's script.

Plain modules, no Ray or gRPC: `config` (CodeExecConfig), `task`/`build` (tasks in the MLE-bench
layout, the bundled ones built offline), `extract` (code from a completion), `sandbox` (isolated
execution), `grading` (checks, metrics, rewards), `verifier` (CodeExecTask: cases/score),
`ladder` (reference scripts, the yardstick).
"""
