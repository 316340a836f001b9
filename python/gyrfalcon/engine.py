"""In-process engine: the scheduler and one step worker without processes or IPC.

For offline batch generation and for tests that drive the exact code paths of
the server (same Scheduler, same StepWorker, same messages) step by step.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.ipc.messages import GenerateRequest, RequestOutput, SamplingParams
from gyrfalcon.scheduler.scheduler import Scheduler, SchedulerConfig
from gyrfalcon.worker.bootstrap import build_worker


class LocalEngine:
    def __init__(self, args: ServerArgs, model_dir: str, check_invariants: bool = True):
        """check_invariants: check the page allocator after every step (tests drive this
        engine; offline generation over a large KV pool may turn it off)."""
        self.model_dir = model_dir
        self.model_cfg = ModelConfig.from_dir(model_dir)
        self.args = args = args.resolved(self.model_cfg)
        self.worker, context_len = build_worker(args, model_dir, self.model_cfg, rank=0)
        assert self.worker.executor.kv_cache is not None
        self.scheduler = Scheduler(
            SchedulerConfig.from_args(
                args,
                self.worker.executor.kv_cache.num_pages,
                context_len,
                self.model_cfg.eos_token_ids,
                check_invariants=check_invariants,
                float_rows=self.worker.floats_rows,
            )
        )

    def add(self, rid: str, prompt_ids: list[int], sampling: SamplingParams) -> None:
        self.scheduler.add_request(GenerateRequest(rid, prompt_ids, sampling))

    def abort(self, rid: str) -> None:
        self.scheduler.abort(rid)

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns the outputs the frontend would receive."""
        return self.scheduler.pump(self.worker.submit, self.worker.take)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def generate(self, prompts: Iterable[list[int]], sampling: SamplingParams) -> list[list[int]]:
        """Run prompts to completion; returns the output token ids of each."""
        prompts = list(prompts)
        for i, p in enumerate(prompts):
            self.add(str(i), p, sampling)
        results: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
        while self.has_work():
            for out in self.step():
                results[out.rid].extend(out.token_ids)
        return [results[str(i)] for i in range(len(prompts))]

    @torch.inference_mode()
    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
