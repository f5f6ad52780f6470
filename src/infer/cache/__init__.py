from .base import AttnMeta, KVCachePool
from .paged import PagedKVCachePool
from .slotted import SlottedKVCache

__all__ = ["AttnMeta", "KVCachePool", "PagedKVCachePool", "SlottedKVCache"]
