"""offloadd: the per-node offload daemon that owns the host tier and the event log.

gRPC core's fork handlers are turned off here, before anything imports grpc (the daemon's entry
points import this package first): left on, they start gRPC's threads again inside the child
that ``os.fork`` makes for a checkpoint export (offloadd.log.forked_export), where they run over
the parent's copied pollers and calls and can crash it (SIGSEGV; DECISIONS 39, 51). Nothing here
forks and then uses gRPC in the child, which is all those handlers are for. An explicit
``GRPC_ENABLE_FORK_SUPPORT`` in the environment is left as it is.
"""

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
