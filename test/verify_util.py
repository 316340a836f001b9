"""VERIFY-shaped forwards for the graph tests (CPU static replay, GPU CUDA graphs):
rows of k + 1 query tokens on top of cached prefixes of different lengths, run
eagerly, through the executor's captured VERIFY graphs, and as one PREFILL of the
whole rows (an independent path to the same logits)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.forward.metadata import RowInput, build_batch_tensors
from gyrfalcon.ipc.contract import DUMMY_PAGE
from gyrfalcon.ipc.messages import ForwardMode
from gyrfalcon.worker.bootstrap import build_worker
from gyrfalcon.worker.executor import ForwardOutput, ModelExecutor


def build_executor(model_dir: str, **kw) -> tuple[ModelExecutor, int]:
    """(the executor of a freshly built worker, its context length); kw: ServerArgs."""
    cfg = ModelConfig.from_dir(model_dir)
    args = ServerArgs(model=model_dir, **kw).resolved(cfg)
    worker, context = build_worker(args, model_dir, cfg, rank=0)
    return worker.executor, context


@dataclass
class VerifyCase:
    prefixes: list[list[int]]  # each row's cached tokens
    drafts: list[list[int]]  # each row's k + 1 scored tokens (last accepted + k drafts)
    pages: list[list[int]]  # each row's page table (never the dummy page)


def make_case(ex: ModelExecutor, prefix_lens: list[int], k: int, seed: int = 0) -> VerifyCase:
    """Random rows on pages 1.. handed out in reverse (scrambled tables), as few as the
    rows need: the test's KV pool can be that small."""
    gen = torch.Generator().manual_seed(seed)
    vocab, ps = ex.cfg.vocab_size, ex.page_size
    need = [-(-(n + k + 1) // ps) for n in prefix_lens]
    assert sum(need) < ex.kv_cache.num_pages, "KV pool too small for the case"
    free = [p for p in range(sum(need), 0, -1) if p != DUMMY_PAGE]
    pages = []
    for n in need:
        pages.append(free[:n])
        free = free[n:]
    prefixes = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in prefix_lens]
    drafts = [torch.randint(3, vocab, (k + 1,), generator=gen).tolist() for _ in prefix_lens]
    return VerifyCase(prefixes, drafts, pages)


@torch.inference_mode()
def forward(ex: ModelExecutor, mode: ForwardMode, rows: list[RowInput], graphs: bool):
    """(executor output, batch tensors) of one forward; graphs=False runs it eagerly."""
    bt = build_batch_tensors(rows, ex.page_size, ex.device)
    every = mode in (ForwardMode.DECODE, ForwardMode.VERIFY)  # logits of every token
    tokens = torch.arange(bt.input_ids.shape[0]) if every else bt.last_token_idx.cpu()
    saved = ex.graphs
    ex.graphs = saved if graphs else None
    try:
        return ex.forward(mode, bt, tokens.to(ex.device), every_token=every), bt
    finally:
        ex.graphs = saved


def prefill_prefixes(ex: ModelExecutor, case: VerifyCase) -> None:
    rows = [RowInput(0, p, pg) for p, pg in zip(case.prefixes, case.pages)]
    forward(ex, ForwardMode.PREFILL, rows, graphs=False)


def verify(ex: ModelExecutor, case: VerifyCase, graphs: bool) -> ForwardOutput:
    """The VERIFY step (prefixes prefilled first): logits of every scored token."""
    rows = [RowInput(len(p), d, pg) for p, d, pg in zip(case.prefixes, case.drafts, case.pages)]
    out, bt = forward(ex, ForwardMode.VERIFY, rows, graphs)
    assert out.logits.shape == (bt.input_ids.shape[0], ex.cfg.vocab_size)
    return out


@torch.inference_mode()
def whole_row_logits(ex: ModelExecutor, case: VerifyCase) -> torch.Tensor:
    """The scored tokens' logits from one eager PREFILL of each whole row (prefix +
    drafts, rewriting the same KV): [rows * (k + 1), vocab]."""
    rows = [RowInput(0, p + d, pg) for p, d, pg in zip(case.prefixes, case.drafts, case.pages)]
    out, bt = forward(ex, ForwardMode.PREFILL, rows, graphs=False)
    logits = ex.compute_logits(out.hidden)  # [T, vocab]
    keep = [
        i
        for start, n, d in zip(bt.q_starts_cpu, bt.q_lens_cpu, case.drafts)
        for i in range(start + n - len(d), start + n)
    ]
    return logits[keep]
