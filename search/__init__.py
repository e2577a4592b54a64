"""Tree search over scripts (mle-tree-spec.md): nodes, the AIDE-style mode/parent policy, prompts
per mode, one round grown from injected `generate`/`execute` callables, per-round diagnostics and
archive rows. Pure Python: no Ray, no gRPC, nothing of services/; its settings are the run
config's `search` section (config/search.py). The driver's side is services/tree_round.py."""
