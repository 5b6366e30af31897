"""DCP planners whose non-tensor values use stepvault's safe encoding instead of pickle.

``torch.distributed.checkpoint``'s default planners turn every non-tensor value into
``torch.save`` bytes and load them back with ``torch.load(weights_only=False)``: loading a
foreign checkpoint can run code. These subclasses change exactly that step.
"""

from __future__ import annotations

import io
import json
from typing import Any

from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner import ReadItem, WriteItem, WriteItemType

from ..format import Encoder, decode_value


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
    """DefaultSavePlanner with safe JSON instead of ``torch.save`` for non-tensor values."""

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
