"""Which node a rank runs on, and which node keeps a copy of its memory checkpoints.

A node is the unit that fails together (its memory goes with it). Its id comes from, in
order: ``STEPVAULT_NODE`` (forced; tests simulate several nodes on one machine with it),
torchrun's ``GROUP_RANK`` (the node's rank in an elastic job), ``NODE_RANK`` (the
launcher's), else the hostname. The local rank is ``LOCAL_RANK`` when set, else the
rank's position among the ranks that share its node id.

The buddy of a rank is the rank that stores the replicas of its memory checkpoints: by
default the rank at the same *position* on the next node of a ring (nodes ordered by their
lowest global rank; a rank's position is its place among its node's ranks ordered by local
rank), or at the same position on the node a ``buddies`` map names. Pairing by position
rather than by the ``LOCAL_RANK`` value works for torchrun's layout (every node numbers its
ranks 0..k-1) and for nodes simulated on one machine whose ranks keep the launcher's
``LOCAL_RANK`` (0 on one node, 1 on the other). A rank with no partner (one node only,
or a buddy node with fewer ranks) gets none, and :meth:`NodeLayout.no_buddy_reason` says
why (the replicated mem tier warns with it and logs a ``replica_no_buddy`` event).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import StepvaultError

#: Environment variables read, in order, for a rank's node id.
NODE_ENV = ("STEPVAULT_NODE", "GROUP_RANK", "NODE_RANK")


def node_id(environ: Mapping[str, str] | None = None) -> str:
    """This process's node id (see the module docstring for where it comes from)."""
    env = os.environ if environ is None else environ
    for name in NODE_ENV:
        value = env.get(name, "").strip()
        if value:
            return value
    return socket.gethostname()


@dataclass(frozen=True)
class NodeLayout:
    """Where every rank of a group runs: node ids by global rank, and local ranks."""

    nodes: tuple[str, ...]  # node id of each global rank
    local_ranks: tuple[int, ...]

    @classmethod
    def of(cls, nodes: list[str], local_ranks: list[int | None] | None = None) -> NodeLayout:
        """A layout from each rank's node id (and ``LOCAL_RANK``, when known)."""
        given = local_ranks or [None] * len(nodes)
        seen: dict[str, int] = {}
        local: list[int] = []
        for node, lr in zip(nodes, given, strict=True):
            position = seen.get(node, 0)
            seen[node] = position + 1
            local.append(position if lr is None else int(lr))
        for node in seen:
            ranks = [lr for n, lr in zip(nodes, local, strict=True) if n == node]
            if len(set(ranks)) != len(ranks):
                raise StepvaultError(
                    f"two ranks on node {node!r} report the same local rank ({sorted(ranks)}): "
                    "set STEPVAULT_NODE (or GROUP_RANK) per node and LOCAL_RANK per process"
                )
        return cls(tuple(nodes), tuple(local))

    @property
    def node_order(self) -> list[str]:
        """Node ids ordered by the lowest global rank on each node."""
        return list(dict.fromkeys(self.nodes))

    def rank_of(self, node: str, local_rank: int) -> int | None:
        """The global rank with ``local_rank`` on ``node`` (None: no such rank)."""
        for rank, (n, lr) in enumerate(zip(self.nodes, self.local_ranks, strict=True)):
            if n == node and lr == local_rank:
                return rank
        return None

    def ranks_on(self, node: str) -> list[int]:
        """Global ranks on ``node``, ordered by local rank (a rank's index is its position)."""
        ranks = [r for r, n in enumerate(self.nodes) if n == node]
        return sorted(ranks, key=lambda r: (self.local_ranks[r], r))

    def position(self, rank: int) -> int:
        """``rank``'s place among its node's ranks ordered by local rank (0: the first)."""
        return self.ranks_on(self.nodes[rank]).index(rank)

    def _targets(self, buddy_nodes: Mapping[str, str] | None) -> dict[str, str]:
        order = self.node_order
        if buddy_nodes is None:
            return {n: order[(i + 1) % len(order)] for i, n in enumerate(order)}
        return {n: buddy_nodes[n] for n in order if n in buddy_nodes}

    def no_buddy_reason(self, rank: int, buddy_nodes: Mapping[str, str] | None = None) -> str:
        """Why ``rank`` has no buddy under :meth:`buddies` (call it for a rank without one)."""
        node = self.nodes[rank]
        order = self.node_order
        if len(order) == 1:
            return (
                f"all {len(self.nodes)} ranks report the same node {node!r} (node ids come "
                "from STEPVAULT_NODE, GROUP_RANK, NODE_RANK, else the hostname), so there "
                "is no other node to keep a replica; launch across nodes with torchrun "
                "(it sets GROUP_RANK) or set STEPVAULT_NODE per node"
            )
        peer_node = self._targets(buddy_nodes).get(node)
        if peer_node is None:
            return f"the buddy map names no buddy node for node {node!r}"
        have = len(self.ranks_on(peer_node))
        return (
            f"rank {rank} is rank {self.position(rank) + 1} of node {node!r}, but its buddy "
            f"node {peer_node!r} has only {have} rank(s): give every node the same number "
            "of ranks"
        )

    def buddies(self, buddy_nodes: Mapping[str, str] | None = None) -> dict[int, int]:
        """Global rank -> the global rank that keeps its replicas (absent: no buddy).

        Ring by default; ``buddy_nodes`` maps node id -> buddy node id and must send every
        node to a different node (a permutation), so each rank receives from one rank.
        """
        order = self.node_order
        target = self._targets(buddy_nodes)
        if buddy_nodes is not None:
            unknown = sorted(set(target.values()) - set(order))
            if unknown:
                raise StepvaultError(
                    f"buddy map names nodes {unknown} that are not in the group "
                    f"(nodes: {order}); map each node id to another node's id"
                )
            if any(a == b for a, b in target.items()):
                raise StepvaultError(
                    "buddy map sends a node to itself: its replicas would die with it"
                )
            if len(set(target.values())) != len(target):
                raise StepvaultError(
                    "buddy map sends two nodes to the same buddy; each node must keep the "
                    f"replicas of exactly one other node (a permutation), got {dict(target)}"
                )
        out: dict[int, int] = {}
        for rank, node in enumerate(self.nodes):
            peer_node = target.get(node)
            if peer_node is None or peer_node == node:
                continue  # a single node: nothing to replicate to
            peers = self.ranks_on(peer_node)
            position = self.position(rank)
            if position < len(peers):  # same position: one sender per receiver
                out[rank] = peers[position]
        return out


def discover_layout(group: object | None = None) -> NodeLayout:
    """Collectively learn every rank's node (an all-gather of ``node_id()``/``LOCAL_RANK``)."""
    import torch.distributed as dist

    lr = os.environ.get("LOCAL_RANK")
    mine = (node_id(), int(lr) if lr not in (None, "") else None)
    gathered: list[tuple[str, int | None] | None] = [None] * dist.get_world_size(group)  # type: ignore[arg-type,unused-ignore]
    dist.all_gather_object(gathered, mine, group=group)
    pairs = [g for g in gathered if g is not None]
    return NodeLayout.of([p[0] for p in pairs], [p[1] for p in pairs])


__all__ = ["NODE_ENV", "NodeLayout", "discover_layout", "node_id"]
