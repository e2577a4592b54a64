"""Tree search over scripts (mle-tree-spec.md): nodes, the AIDE-style mode/parent policy, prompts
per mode, one round grown from injected `generate`/`execute` callables, per-round diagnostics and
archive rows. Pure Python (pydantic for the config): no Ray, no gRPC, nothing of services/."""
