"""The one-shot all-reduce over NVLink (`forward/one_shot.py`) on real GPUs: every rank
gets the rank-order float32 sum, bit for bit, eagerly and in CUDA graphs replayed many
times between PDL-launched kernels, for sizes from one element to the largest it takes;
larger tensors still go through NCCL. DP attention's row gathers and reduce-scatters
through it are exact too (`one_shot_util.check_rows_through_one_shot`).

The rank count is GYRFALCON_GPU_RANKS (default 2)."""

import os

import pytest
import torch
from one_shot_util import rank_checks_one_shot
from parallel_util import spawn_ranks

RANKS = int(os.environ.get("GYRFALCON_GPU_RANKS", "2"))

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < RANKS, reason=f"needs {RANKS} GPUs"),
]


def test_one_shot_sums_like_the_reference_eagerly_and_in_graphs(tmp_path):
    spawn_ranks(rank_checks_one_shot, RANKS, str(tmp_path), timeout_s=300)
    for r in range(RANKS):
        assert torch.load(tmp_path / f"rank{r}.pt")["ok"]
