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

    from gyrfalcon.forward import metadata
    from gyrfalcon.layers.attention import triton_backend
    from gyrfalcon.worker import draft_round, drafter, step_worker
    from gyrfalcon.worker.cuda_graph import GraphRunner
    from gyrfalcon.worker.executor import ModelExecutor
    from gyrfalcon.worker.logprobs import HostCopy
    from gyrfalcon.worker.pending_step import PendingStep
    from gyrfalcon.worker.piecewise_graph import PiecewiseGraphs
    from gyrfalcon.worker.request_table import RequestTable
    from gyrfalcon.worker.spec_step_graph import FusedSpecStep
    from gyrfalcon.worker.static_buffers import StaticBuffers
    from gyrfalcon.worker.step_layout import StepLayout

    return {
        "worker launch (all steps)": (step_worker.StepWorker, "_launch"),
        "worker launch fused": (FusedSpecStep, "launch_step"),
        "worker requests.apply": (RequestTable, "apply"),
        "worker layout add_plain": (StepLayout, "add_plain"),
        "worker build_batch_tensors": (step_worker, "build_batch_tensors"),
        "  padded_page_table": (metadata, "padded_page_table"),
        "  upload_int64 (pinned copy, H2D)": (metadata, "upload_int64"),
        "target forward (eager path)": (ModelExecutor, "forward"),
        "piecewise run": (PiecewiseGraphs, "run"),
        "piecewise attention": (PiecewiseGraphs, "_attend"),
        "triton build_metadata": (triton_backend.TritonBackend, "build_metadata"),
        "extend_attention launch": (triton_backend, "extend_attention"),
        "graph static buffers fill": (StaticBuffers, "fill"),
        "triton prepare_replay": (triton_backend.TritonBackend, "prepare_replay"),
        "graph replay (any)": (torch.cuda.CUDAGraph, "replay"),
        "verify_sample": (step_worker, "verify_sample"),
        "sampler prepare": (step_worker, "prepare"),
        "sample": (step_worker, "sample"),
        "host copy of sampled ids": (HostCopy, "__init__"),
        "record_last": (RequestTable, "record_last"),
        "drafter draft_step": (drafter.Drafter, "draft_step"),
        "drafter build_batch_tensors": (draft_round, "build_batch_tensors"),
        "drafter eager forward": (drafter.Drafter, "_forward"),
        "drafter replay after extend": (drafter.Drafter, "_replay_after_extend"),
        "graph runner run": (GraphRunner, "run"),
        "worker take (results to the host)": (step_worker.StepWorker, "take"),
        "  pending resolve": (PendingStep, "resolve"),
        "Triton launches (all)": (JITFunction, "run"),
    }
