from mooncake.store import MooncakeDistributedStore
import numpy as np
s = MooncakeDistributedStore()
print("setup", s.setup("127.0.0.1", "P2PHANDSHAKE", 32<<20, 16<<20, "tcp", "", "localhost:50123"), flush=True)
print("put", s.put("x", b"abc"))
