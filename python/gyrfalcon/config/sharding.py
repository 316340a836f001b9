"""How the model's tensors split over ranks: attention heads, even row/column shards,
vocabulary rows and MoE experts (pure index math, no torch), and `check_parallel_fit`,
which asks the same functions, when the flags are resolved, whether a model splits over
the ranks its flags ask for. The layers build their shards with them through
`forward.parallel.ParallelContext`; kept below every package (config) so that flag
resolution asks the very rules the layers follow."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gyrfalcon.config.model_config import ModelConfig


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one TP rank holds (global head indices)."""

    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank (1, replicated, when tp > KV heads)
    head_start: int  # its first query head: it holds [head_start, head_start + num_heads)
    kv_head_start: int  # its first KV head: [kv_head_start, kv_head_start + num_kv_heads)


def shard_heads(num_heads: int, num_kv_heads: int, tp_rank: int, tp_size: int) -> HeadShard:
    """Rank tp_rank's heads when tp_size ranks split the attention by heads.

    Query heads split evenly: H / tp each, rank r holding [r H/tp, (r+1) H/tp).
    KV heads split evenly when tp <= KVH (KVH / tp each); when tp > KVH every rank
    holds one KV head, each replicated on tp / KVH consecutive ranks: rank r holds
    head r // (tp / KVH). Either way a rank's query heads are exactly those that
    attend to its KV heads (GQA group g = H / KVH: query head h reads KV head h // g).
    Raises ValueError unless tp divides H, and tp divides or is a multiple of KVH.
    """
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp rank {tp_rank} is not in a group of {tp_size}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    if num_heads % tp_size:
        raise ValueError(f"{num_heads} attention heads do not split over tp size {tp_size}")
    q = num_heads // tp_size
    if tp_size <= num_kv_heads:
        if num_kv_heads % tp_size:
            raise ValueError(f"{num_kv_heads} KV heads do not split over tp size {tp_size}")
        kv = num_kv_heads // tp_size
        return HeadShard(q, kv, tp_rank * q, tp_rank * kv)
    if tp_size % num_kv_heads:
        raise ValueError(
            f"tp size {tp_size} is neither a divisor nor a multiple of {num_kv_heads} KV heads"
        )
    return HeadShard(q, 1, tp_rank * q, tp_rank // (tp_size // num_kv_heads))


def local_heads(num_heads: int, num_kv_heads: int, tp_size: int) -> tuple[int, int]:
    """(query heads, KV heads) on each rank of a TP group (the same on every rank):
    what the attention backends and the KV cache are sized with."""
    shard = shard_heads(num_heads, num_kv_heads, 0, tp_size)
    return shard.num_heads, shard.num_kv_heads


def even_shard(size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """(start, length) of rank tp_rank's part when `size` rows or columns split evenly."""
    if size % tp_size:
        raise ValueError(f"size {size} does not split over tp size {tp_size}")
    part = size // tp_size
    return tp_rank * part, part


@dataclass(frozen=True)
class VocabShard:
    """The vocabulary rows one TP rank holds of an embedding or LM head."""

    start: int  # its first token id: it holds ids [start, start + num_ids)
    num_ids: int  # real ids on this rank (0 on trailing ranks of a tiny vocabulary)
    num_rows: int  # rows it allocates, the same on every rank: the last num_rows - num_ids pad
    padded_vocab: int  # num_rows * tp: the width of the gathered logits, padding included


def shard_vocab(vocab_size: int, tp_rank: int, tp_size: int) -> VocabShard:
    """Rank tp_rank's rows when tp_size ranks split a vocabulary of V ids by rows.

    Every rank holds P = ceil(V / tp) rows: rank r the ids [r P, min((r + 1) P, V)),
    then zero rows up to P. The padding thus sits after the last id, at gathered
    positions [V, tp P): logits gathered in rank order are the vocabulary in order
    followed by tp P - V padding columns, which the LM head drops. At tp 1 a rank
    holds all V ids in V rows, no padding.
    """
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp rank {tp_rank} is not in a group of {tp_size}")
    if vocab_size < 1:
        raise ValueError(f"vocabulary of {vocab_size} ids")
    rows = -(-vocab_size // tp_size)
    start = min(tp_rank * rows, vocab_size)
    return VocabShard(start, min(rows, vocab_size - start), rows, rows * tp_size)


@dataclass(frozen=True)
class ExpertShard:
    """The MoE experts one rank holds: experts [start, start + num_experts), each with
    intermediate rows [inter_start, inter_start + inter_size) of its full I."""

    start: int
    num_experts: int
    inter_start: int
    inter_size: int

    def owns(self, expert: int) -> bool:
        return self.start <= expert < self.start + self.num_experts


def shard_experts(
    num_experts: int, intermediate_size: int, tp_rank: int, tp_size: int, ep_size: int
) -> ExpertShard:
    """Rank tp_rank's share of a MoE layer's E experts of intermediate size I.

    ep_size 1 (MoE-TP): all E experts, intermediate rows [r I/tp, (r+1) I/tp) of each.
    ep_size == tp_size (EP): experts [r E/ep, (r+1) E/ep), all I rows of each.
    Raises ValueError when the split is not even.
    """
    if ep_size == 1:
        if intermediate_size % tp_size:
            raise ValueError(
                f"expert intermediate size {intermediate_size} does not split over tp size "
                f"{tp_size} (MoE-TP); expert parallelism may fit"
            )
        part = intermediate_size // tp_size
        return ExpertShard(0, num_experts, tp_rank * part, part)
    if ep_size != tp_size:
        raise ValueError(f"ep size {ep_size} is neither 1 nor the tp size {tp_size}")
    if num_experts % ep_size:
        raise ValueError(f"{num_experts} experts do not split over ep size {ep_size}")
    per = num_experts // ep_size
    return ExpertShard(tp_rank * per, per, 0, intermediate_size)


def check_parallel_fit(model: ModelConfig, tp_size: int, dp_size: int, ep_size: int) -> None:
    """ValueError naming the flags when the model's attention heads, dense MLP or experts
    do not split over the ranks that --tp-size, --dp-size and --ep-size ask for: rank 0's
    shards (every rank's are the same size) from the functions above, before any process
    starts. Under DP attention (ep = tp x dp > tp) the experts split over every rank. An
    EAGLE3 drafter splits like a dense target over the TP group (its `DraftConfig.layer`,
    `config/resolve.py`)."""
    flags = f"--tp-size {tp_size}"
    if model.num_experts:
        flags += f" --dp-size {dp_size} --ep-size {ep_size}"
    try:
        shard_heads(model.num_heads, model.num_kv_heads, 0, tp_size)
        if len(model.moe_layers) < model.num_layers:  # dense MLPs: column/row-parallel
            even_shard(model.intermediate_size, 0, tp_size)
        if model.num_experts:
            world = tp_size * dp_size
            if ep_size == world > tp_size:  # NOTE: as forward/distributed.py groups them
                shard_experts(model.num_experts, model.moe_intermediate_size, 0, world, world)
            else:
                shard_experts(model.num_experts, model.moe_intermediate_size, 0, tp_size, ep_size)
    except ValueError as e:
        raise ValueError(f"{flags}: {e}") from None
