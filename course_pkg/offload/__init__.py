"""A second tier behind the device pool: KV blocks kept in CPU memory, found again by hash (chapter 15)."""
from course_pkg.offload.connector import KVTransferConfig, OffloadingConnector
from course_pkg.offload.manager import (ARCOffloadingManager, FilterReusedOffloadingManager, LoadStoreSpec,
                                        LRUOffloadingManager, OffloadingManager, PrepareStoreOutput,
                                        SLRUOffloadingManager)

__all__ = ["OffloadingManager", "LRUOffloadingManager", "ARCOffloadingManager", "FilterReusedOffloadingManager",
           "SLRUOffloadingManager", "LoadStoreSpec", "PrepareStoreOutput", "KVTransferConfig", "OffloadingConnector"]
