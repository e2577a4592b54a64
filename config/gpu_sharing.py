"""How the rollout replica and the learner share one GPU. Pydantic only: keep this import-light.

Two processes on one GPU time-slice it: the learner's kernels run between the replica's decode
steps, so its GPU time is added to generation's (issue 34's measurements, shared/MEASURED.md).
Under CUDA MPS (Multi-Process Service) their kernels run at the same time on different SMs; with
the learner capped at a share of the SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE), ~46% of a
learner-like load hid beside a GPU-bound 4B decode on an H200, and all of it beside a host-bound
one. services/mps.py starts and quits the daemon; the caveat is MPS's own: a fatal fault in one
client (an illegal address, an out-of-memory abort) ends the other clients of its server too.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class GpuSharingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: Literal["auto", "timeslice", "mps"] = Field(
        "auto", description="'auto' (the default): 'mps' where it was measured to pay, that is one vLLM "
        "replica and one learner worker sharing one GPU of a local cluster with trainer.mode=one_step_off "
        "(the update then runs beside generation, README), the "
        "control binary is found, and every GPU the host's CUDA sees is a model where that was measured (the "
        "H200, -5% at 1x8 and -15% at 4x8; the H100 80GB HBM3, -7% at 1x8 on one machine and a wash at 4x8; "
        "on any other model auto time-slices); 'timeslice' anywhere else "
        "(RunConfig.gpu_sharing_auto_blocker says why), and also when the daemon does not start, a throwaway "
        "CUDA client cannot connect under it (MPS is documented for data-center and workstation GPUs), or a "
        "capped role's GEMMs come out wrong under its share (learner_sm_percent), all checked before any GPU "
        "process of the run exists; run.json records what ran and why. "
        "'timeslice': the GPU's default scheduling (one process's kernels at a "
        "time). 'mps': the run joins the CUDA MPS daemon already serving this host (CUDA_MPS_PIPE_DIRECTORY, "
        "else /tmp/nvidia-mps), or starts one whose pipe and log directories are under the run directory "
        "and quits it at exit; the replica (and vLLM's engine core) and the learner's workers get the "
        "daemon's variables and their SM shares. run.json `gpu_sharing` records which. Never changes the "
        "GPU's compute mode. Caveat: a fatal GPU fault in one MPS client ends the others (the run then "
        "fails, and --resume continues it). Needs a GPU rollout and a GPU learner, on a local cluster "
        "(the daemon is started on the driver's host)."
    )
    learner_sm_percent: int = Field(
        50, ge=1, le=100, description="With mode=mps: the share of the GPU's SMs each learner worker's "
        "kernels may use (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE). Below 100 leaves SMs free for the replica's "
        "decode steps, so that the update runs beside generation instead of between its steps. Measured: 50 "
        "(H200, H100) and 100 (H200); on an H100 caps of 20 and 30 hid less of the update than 50 (bench/"
        "gpu_overlap.py). A capped client can compute wrong numbers: on an H100 and an H200 (driver 580.159.04) "
        "the learner's bf16 LoRA GEMMs came out nan or wrong at most shares from 15 to 85 (60, 75 and 80 among "
        "them), right at 5, 10, 25, 50, 90 and 95 on both (bench/results/gpu-2026-12-06-h100, -h200). So "
        "every role below 100 runs model/gemm_check.py as a client under its share before any GPU process of "
        "the run exists: mode=mps refuses a share whose GEMMs are wrong in one line, auto time-slices instead; "
        "run.json gpu_sharing.numerics keeps the check's result."
    )
    rollout_sm_percent: int = Field(
        100, ge=1, le=100, description="With mode=mps: the share of the SMs each rollout replica may use "
        "(100 = no cap)."
    )
    learner_priority: Literal["normal", "below_normal"] = Field(
        "normal", description="With mode=mps: the learner workers' MPS client priority "
        "(CUDA_MPS_CLIENT_PRIORITY, 0 = normal, 1 = below normal). 'below_normal': the GPU schedules the "
        "replica's pending kernels (its decode steps) ahead of the learner's, which fill the SMs they leave; "
        "a hint to the scheduler, no pre-emption of running kernels. Measured on an H200 (bench/gpu_overlap.py, "
        "bench/results/gpu-2026-12-06-h200): at learner_sm_percent=100 it hid none of an update under a 4B "
        "decode (the update's GEMM blocks already hold every SM), and with the 50% cap no more than the cap "
        "alone; so the default leaves the priority as CUDA sets it."
    )

    def priority_under_timeslice(self) -> bool:
        """A learner priority beside mode=timeslice, where no MPS client exists for it to apply to.
        By value, not by what was written: run.json carries every field, defaults included. (An
        SM share beside timeslice stays allowed, as before: refusing it now could stop the resume
        of a run that recorded one.)"""
        return self.mode == "timeslice" and self.learner_priority != "normal"
