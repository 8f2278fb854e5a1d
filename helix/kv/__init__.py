from helix.kv.allocator import PageAllocator
from helix.kv.manager import KVManager, LocalKVMeta
from helix.kv.ownership import KVSharding, kv_owner, local_index, local_len, local_to_global

__all__ = ["PageAllocator", "KVManager", "KVSharding", "LocalKVMeta", "kv_owner", "local_index",
           "local_len", "local_to_global"]
