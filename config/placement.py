"""Where a part of a run may run on a multi-node Ray cluster: the fields the grader, rollout and
learner sections share (custom resources and node labels). Pydantic only: keep this import-light.

Both default to "no constraint" (empty): a part then goes wherever Ray has room, as on one node.
Nodes get custom resources and labels when they join (`ray start --resources '{"rollout_slot": 1}'
--labels counterpoint-role=rollout`); a part that names them lands only on nodes offering them.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field

# Ray's own resource names: the sections have their own fields for them (num_cpus, num_gpus,
# replica_memory_mb, ...), so a custom-resource table naming one would book it twice.
RAY_BUILTIN_RESOURCES = frozenset({"CPU", "GPU", "TPU", "memory", "object_store_memory"})
# A label value in a selector: `v`, `!v`, `in(a,b)`, `!in(a,b)` (Ray's label selector syntax).
_SELECTOR_VALUE = re.compile(r"^!?(in\([^()]*\)|[^!()]*)$")


def resources_field(part: str, example: str) -> Any:
    return Field(
        default_factory=dict,
        description=f"Custom Ray resources each {part} reserves, name -> amount (e.g. {example}); a "
        f"{part} then lands only on nodes started with that resource (`ray start --resources`). "
        "CPUs, GPUs and memory have their own fields. Empty = no constraint.",
    )


def label_selector_field(part: str, example: str) -> Any:
    return Field(
        default_factory=dict,
        description=f"Node labels a {part}'s node must carry, key -> value (e.g. {example}; Ray's "
        "label selectors: a value may also be `!v`, `in(a,b)` or `!in(a,b)`). Nodes get labels with "
        "`ray start --labels k=v`. Empty = any node.",
    )


def check_resources(where: str, resources: dict[str, float]) -> dict[str, float]:
    """ValueError naming the key when a custom-resource table names a Ray built-in or a
    non-positive amount."""
    for name, amount in resources.items():
        if name in RAY_BUILTIN_RESOURCES:
            raise ValueError(f"{where} names Ray's own resource {name!r}; use the section's CPU/GPU/memory "
                             "fields for it")
        if not name or amount <= 0:
            raise ValueError(f"{where}[{name!r}] must name a resource and reserve a positive amount, got {amount!r}")
    return resources


def check_label_selector(where: str, selector: dict[str, str]) -> dict[str, str]:
    for key, value in selector.items():
        if not key.strip() or not str(value).strip() or not _SELECTOR_VALUE.match(str(value)):
            raise ValueError(f"{where}: {key!r}: {value!r} is not a label selector (k: v, k: '!v', "
                             "k: 'in(a,b)' or k: '!in(a,b)')")
    return selector
