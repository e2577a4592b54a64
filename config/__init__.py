"""The config layer: the one schema of a counterpoint run, and the process environment every
entry point sets. The bottom of the dependency graph: every package of ours but records/
imports it; it imports nothing of ours (pydantic and yaml only). Defaults live here and nowhere
else: code that needs one reads it from the schema (e.g. ``GraderConfig().max_retries``).

- config/run.py: RunConfig (seed, run_name and one section per service), TrainerConfig,
  EvalConfig; loading a YAML file plus dotted overrides; paths made absolute where read.
- config/grader.py, config/rollout.py, config/learner.py: the service sections.
- config/runtime_env.py: the process environment's defaults (offline hubs, vLLM CPU mode, NCCL)
  applied before Ray, vLLM or torch is imported and handed to Ray workers, and the cache
  directory; its docstring names the few variables set elsewhere and why.
"""

from config.grader import GraderConfig
from config.learner import LearnerConfig, LoraConfig
from config.rollout import ModelConfig, RolloutConfig
from config.run import (
    PATH_FIELDS,
    RESUME_MAY_CHANGE,
    RUN_LOCATION,
    ConfigError,
    EvalConfig,
    RunConfig,
    TrainerConfig,
    apply_override,
    config_changes,
    config_from_dict,
    config_with_overrides,
    load_config,
    resolved,
    split_resume_changes,
    with_absolute_paths,
)

__all__ = [
    "PATH_FIELDS", "RESUME_MAY_CHANGE", "RUN_LOCATION", "ConfigError", "EvalConfig", "GraderConfig",
    "LearnerConfig", "LoraConfig", "ModelConfig", "RolloutConfig", "RunConfig", "TrainerConfig", "apply_override",
    "config_changes", "config_from_dict", "config_with_overrides", "load_config", "resolved", "split_resume_changes", "with_absolute_paths",
]
