from helix.attention.backend import AttentionBackend, get_backend
from helix.attention.merge import merge_partials, pack_partials, unpack_partials

__all__ = ["AttentionBackend", "get_backend", "merge_partials", "pack_partials", "unpack_partials"]
