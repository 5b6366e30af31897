"""DCP planners whose non-tensor values use stepvault's safe encoding instead of pickle.

``torch.distributed.checkpoint``'s default planners turn every non-tensor value into
``torch.save`` bytes and load them back with ``torch.load(weights_only=False)``: loading a
foreign checkpoint can run code. These subclasses change exactly that step.
"""

from __future__ import annotations

import dataclasses
import io
import json
from typing import Any

from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner import ReadItem, SavePlan, WriteItem, WriteItemType

from ..format import Encoder, decode_value

#: the top-level entry of a collective save's DCP state that records each entry's kind
KINDS_KEY = "__stepvault_kinds__"


def encode_value(value: Any, fqn: str) -> bytes:
    """Safe JSON bytes of one non-tensor value (refused with its name if unsupported)."""

    # Arrays inside a value (e.g. numpy's RNG key) are embedded: they are small.
    return json.dumps(Encoder(None).encode(value, (fqn,)), allow_nan=False).encode()


def decode_value_bytes(data: bytes) -> Any:
    """Inverse of :func:`encode_value`."""
    return decode_value(json.loads(data), lambda kind, name: None)


def set_element(root: dict[str, Any], path: tuple, value: Any) -> None:
    """Set ``value`` at the nested ``path`` of ``root`` (dicts and lists), creating dicts."""
    node: Any = root
    for key in path[:-1]:
        node = node[key] if isinstance(node, list) else node.setdefault(key, {})
    node[path[-1]] = value


class SafeSavePlanner(DefaultSavePlanner):
    """DefaultSavePlanner with safe JSON instead of ``torch.save`` for non-tensor values,
    and rank 0's copy of what every rank holds outside the modules and optimizers.

    DCP keeps one copy of an entry every rank holds, from the rank with the least planned
    bytes: for a DDP model's replicated tensors that spreads the writing over the ranks.
    For the rest of a state (values, counters, a scheduler's or another object's state)
    that was any rank's copy, rank 1's in practice, where the documented rule (as Lightning
    and the Trainer keep their files) is rank 0's; a rank's own state (RNGs, data loaders)
    is stored per rank (:func:`~.state.per_rank`)."""

    _rank0_keys: frozenset[str] = frozenset()

    def set_up_planner(self, state_dict: Any, *args: Any, **kwargs: Any) -> None:
        kinds = state_dict.get(KINDS_KEY) if isinstance(state_dict, dict) else None
        if isinstance(kinds, dict):
            spread = ("module", "optimizer")
            self._rank0_keys = frozenset(
                [KINDS_KEY, *(k for k, kind in kinds.items() if kind not in spread)]
            )
        super().set_up_planner(state_dict, *args, **kwargs)

    def create_global_plan(self, all_plans: list[SavePlan]) -> Any:
        if self._rank0_keys:
            first: dict[Any, int] = {}
            for i, plan in enumerate(all_plans):
                for item in plan.items:
                    if self._top_key(item.index.fqn) in self._rank0_keys:
                        first.setdefault(item.index, i)
            all_plans = [
                dataclasses.replace(
                    plan, items=[it for it in plan.items if first.get(it.index, i) == i]
                )
                for i, plan in enumerate(all_plans)
            ]
        return super().create_global_plan(all_plans)

    def _top_key(self, fqn: str) -> str:
        path = getattr(self, "mappings", {}).get(fqn)
        return str(path[0]) if path else fqn.split(".", 1)[0]

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(encode_value(object, write_item.index.fqn))
        return object


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that decodes non-tensor values from safe JSON, never unpickling."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        decoded = decode_value_bytes(value.read())
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], decoded)
        else:
            self.state_dict[read_item.dest_index.fqn] = decoded
