"""Format layer: object files, manifests, codecs, hashing and the safe object encoding."""

from .codecs import CODEC_CHOICES, choose_codec, get_codec
from .encoding import Encoder, decode_value, register_type, unregister_type
from .hashing import content_hash
from .manifest import (
    MANIFEST_FORMAT_VERSION,
    Manifest,
    ObjectEntry,
    TensorEntry,
    parse_manifest,
    serialize_manifest,
)
from .objects import OBJECT_FORMAT_VERSION, decode_object, encode_object, parse_header

__all__ = [
    "CODEC_CHOICES",
    "MANIFEST_FORMAT_VERSION",
    "OBJECT_FORMAT_VERSION",
    "Encoder",
    "Manifest",
    "ObjectEntry",
    "TensorEntry",
    "choose_codec",
    "content_hash",
    "decode_object",
    "decode_value",
    "encode_object",
    "get_codec",
    "parse_header",
    "parse_manifest",
    "register_type",
    "serialize_manifest",
    "unregister_type",
]
