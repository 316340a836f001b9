"""The worker's step phases by name, for `profiling.SectionTimes`: what
`bench_spec_step.py --time-sections` times in-process and
`GYRFALCON_SECTION_TIMES=DIR gyrfalcon serve ...` times in every served worker
(`profiling.process_sections`). Each is `(owner, attribute)`: a class's method, or a
module's function where the caller looks it up. Sections nest (a launch holds the
forward that holds the attention), so their totals overlap.
"""

from __future__ import annotations

import torch


def worker_sections() -> dict[str, tuple[object, str]]:
    """The sections of a worker's step, in the order of the step."""
    from triton.runtime.jit import JITFunction

    from gyrfalcon.layers.attention import triton_backend
    from gyrfalcon.worker import draft_round, drafter, step_worker
    from gyrfalcon.worker.cuda_graph import GraphRunner
    from gyrfalcon.worker.executor import ModelExecutor
    from gyrfalcon.worker.piecewise_graph import PiecewiseGraphs

    return {
        "worker launch (all steps)": (step_worker.StepWorker, "_launch"),
        "worker launch fused": (step_worker.StepWorker, "_launch_fused"),
        "worker build_batch_tensors": (step_worker, "build_batch_tensors"),
        "target forward (eager path)": (ModelExecutor, "forward"),
        "piecewise run": (PiecewiseGraphs, "run"),
        "piecewise attention": (PiecewiseGraphs, "_attend"),
        "triton build_metadata": (triton_backend.TritonBackend, "build_metadata"),
        "extend_attention launch": (triton_backend, "extend_attention"),
        "graph replay (any)": (torch.cuda.CUDAGraph, "replay"),
        "verify_sample": (step_worker, "verify_sample"),
        "sample": (step_worker, "sample"),
        "drafter draft_step": (drafter.Drafter, "draft_step"),
        "drafter build_batch_tensors": (draft_round, "build_batch_tensors"),
        "drafter eager forward": (drafter.Drafter, "_forward"),
        "drafter replay after extend": (drafter.Drafter, "_replay_after_extend"),
        "graph runner run": (GraphRunner, "run"),
        "worker take (results to the host)": (step_worker.StepWorker, "take"),
        "Triton launches (all)": (JITFunction, "run"),
    }
