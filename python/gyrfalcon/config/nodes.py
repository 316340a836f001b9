"""The multi-node flags (`--nnodes`, `--node-rank`, `--dist-init-addr`), checked when
the arguments are built, before anything loads, so a bad combination fails at once
with the flag's name."""

from __future__ import annotations

TCP_SCHEME = "tcp://"


def parse_init_addr(addr: str) -> tuple[str, int]:
    """(host, port) of "host:port" (SGLang's form) or "tcp://host:port"; ValueError
    naming the flag otherwise."""
    host, sep, port = addr.removeprefix(TCP_SCHEME).rpartition(":")
    if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"--dist-init-addr {addr!r} is not HOST:PORT")
    return host, int(port)


def init_url(addr: str) -> str:
    """The "tcp://host:port" form torch.distributed's init_method takes."""
    host, port = parse_init_addr(addr)
    return f"{TCP_SCHEME}{host}:{port}"


def check_nodes(nnodes: int, node_rank: int, world_size: int, dist_init_addr: str | None) -> None:
    """ValueError, naming the flags, unless the world's ranks split evenly over nnodes
    nodes, node_rank is one of them and (with several nodes) the head's address is
    given."""
    if nnodes < 1:
        raise ValueError(f"--nnodes must be at least 1, got {nnodes}")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank {node_rank} is not in [0, {nnodes}) (--nnodes {nnodes})")
    if world_size % nnodes:
        raise ValueError(
            f"the {world_size} worker ranks (--tp-size x --dp-size) do not split evenly "
            f"over --nnodes {nnodes}"
        )
    if nnodes > 1 and dist_init_addr is None:
        raise ValueError(
            f"--nnodes {nnodes} needs --dist-init-addr HOST:PORT: the head's (node 0's) "
            "address, the same on every node"
        )
    if dist_init_addr is not None:
        parse_init_addr(dist_init_addr)


def tp_groups_within_nodes(world_size: int, tp_size: int, nnodes: int) -> bool:
    """Whether every TP group's ranks run on one node. Groups are tp_size consecutive
    ranks from a multiple of tp_size, and node n runs the k = world / nnodes ranks from
    n k, so each group stays on one node exactly when tp_size divides k. Memory that
    peers read directly (the one-shot all-reduce) needs that."""
    ranks_per_node = world_size // nnodes
    return ranks_per_node % tp_size == 0
