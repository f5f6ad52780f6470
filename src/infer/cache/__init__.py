from .base import AttnMeta, KVCachePool
from .slotted import SlottedKVCache

__all__ = ["AttnMeta", "KVCachePool", "SlottedKVCache"]
