"""The model every engine and the learner load, as data: where the base model's files come from
and which tokens end a completion (base.py), the LoRA adapter's versions and payload as they
cross processes (adapter.py), and a payload as a peft adapter directory (adapter_dir.py).

The layer under rollout/ and learner/, which both need these and must not import each other; it
imports config/ only (and torch/transformers inside the functions that load weights)."""
