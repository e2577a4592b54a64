"""The LoRA adapter as it travels between the learner, the driver and the rollout replicas: its
version numbering and its payload. No torch, Ray or vLLM import at module level: these objects
cross process boundaries (the Ray object store, Serve handles, Train workers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Adapter versions, one numbering end to end (DESIGN.md): 0 is the bare base model (no adapter);
# the adapter after k optimizer steps is version k + 1, stamped by the learner where it is made,
# so step s samples with version s and the init adapter is version 1.
BASE_MODEL_VERSION = 0


def adapter_version(updates: int) -> int:
    """The version of the adapter that ``updates`` optimizer steps produced."""
    return updates + 1


FIRST_ADAPTER_VERSION = adapter_version(0)  # also what a lone adapter dir is served as (eval, probe)


@dataclass(frozen=True)
class AdapterPayload:
    """A published LoRA adapter: a safetensors state dict (peft naming) and its adapter_config.
    Travels through the Ray object store; never through a shared disk.

    ``safetensors`` is the file's bytes: a ``bytes`` object, or a contiguous uint8 numpy array
    holding the same bytes, which is what the learner makes (learner/lora.py). An array crosses
    Ray's object store without a copy on either side (a 4B r=32 adapter is 126 MiB: as bytes,
    pickling, the put and the get copied it three times every step). Readers that only need the
    bytes' contents take ``view()``; ``data()`` gives a ``bytes`` copy.
    """

    version: int
    safetensors: Any  # bytes | numpy.ndarray (uint8, 1-D, contiguous)
    config: dict[str, Any] = field(default_factory=dict)
    checksum: int | None = None  # blob_checksum(safetensors), where the maker computed it (the learner)

    def view(self) -> memoryview:
        """The safetensors bytes without a copy, for writers, hashers and parsers."""
        return memoryview(self.safetensors).cast("B")

    def data(self) -> bytes:
        """The safetensors bytes as a ``bytes`` object (a copy unless they already are one)."""
        return self.safetensors if isinstance(self.safetensors, bytes) else self.view().tobytes()

    def nbytes(self) -> int:
        return self.view().nbytes


@dataclass(frozen=True)
class AdapterRef:
    """An AdapterPayload left in Ray's object store by the process that made it (the learner's
    rank 0), as the driver sees it: the version, and the ref boxed in a list so that Ray hands
    the ref on rather than the value. The driver publishes the ref to the adapter registry and
    the replicas fetch it once, so a 4B r=32 adapter (126 MiB in bf16) no longer crosses the
    coordinator, the driver and a second put on its way (bench/results/gpu-vs-trl.md).
    ``fetch()`` (and ``safetensors``/``config``) get the payload itself, for whoever needs it."""

    version: int
    box: list
    checksum: int | None = None  # the payload's, carried so the registry can tell a re-export apart

    def fetch(self) -> AdapterPayload:
        import ray

        return ray.get(self.box[0])

    @property
    def safetensors(self) -> bytes:
        return self.fetch().data()

    @property
    def config(self) -> dict[str, Any]:
        return self.fetch().config


CHECKSUM_MOD = 65521  # word i of a blob weighs (i mod 65521) + 1 in blob_checksum


def blob_checksum(data) -> int:
    """A checksum of a payload's safetensors bytes: over their little-endian 16-bit words, each
    taken as its signed value + 32768 (v_i in [0, 65536)), the sum of v_i * ((i mod 65521) + 1),
    exact. Position-weighted, so a changed, moved or swapped word changes it. It tells whether
    two exports of "version v" are the same bytes (a learner restored in the run re-exports the
    live version: services/learner_recovery.py). The learner computes it where the tensors are,
    on the GPU a column sum in a few kernels (learner/lora.py ``word_sum``; not yet timed there),
    where a sha256 of 126 MiB would cost the step ~0.1 s of host time. Not a defence against a
    forger: nothing here is written by anyone but the run. This host-side form is the reference."""
    import numpy as np

    words = np.frombuffer(memoryview(data).cast("B"), dtype="<i2").astype(np.int64) + 32768
    weights = np.arange(words.size, dtype=np.int64) % CHECKSUM_MOD + 1
    return int((words * weights).sum())


class AdapterMismatch(ValueError):
    """An adapter whose tensors do not match the LoRA layers it is loaded into."""


def adapter_fit_problem(given: set[str] | list[str], wanted: set[str] | list[str]) -> str | None:
    """Why an adapter file's tensors (``given``, peft's saved names) do not fill the LoRA layers
    peft built from its config on this model (``wanted``, the same names), or None when they do.

    peft loads an adapter non-strictly: tensors that match no layer are dropped, and layers that
    no tensor matches keep their fresh init, with a warning at most. An adapter trained on another
    base (other module names) thus loads as a fresh, randomly initialised one, and the run trains
    or evaluates from there as if it had started from that adapter."""
    given, wanted = set(given), set(wanted)
    missing, unused = sorted(wanted - given), sorted(given - wanted)
    if not missing and not unused:
        return None
    parts = []
    if missing:
        parts.append(f"{len(missing)} of the {len(wanted)} LoRA tensors peft built on this model are not in it "
                     f"(first {missing[0]})")
    if unused:
        parts.append(f"{len(unused)} of its {len(given)} tensors fit no LoRA layer of this model (first {unused[0]})")
    return "; ".join(parts) + ": it was made for another base model or other target modules"
