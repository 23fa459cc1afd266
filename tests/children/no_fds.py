"""a consumer's grant server in a process with no descriptor left: prints its endpoint
and token, then "full"; on stdin, "cpu" prints its CPU seconds, "free" frees the
descriptors it holds"""

import os, resource, sys
from shmhb.kv import grants
from shmhb.kv.fence import FenceServer
from shmhb.kv.loads import Load, LoadTable
t = LoadTable(grants.new_states(sys.argv[1] == "1"))
t.start([Load("a", "127.0.0.2:4000", "e1", frozenset({1}), token=object())])
srv = FenceServer("127.0.0.1", 5, t.states, t.tokens)
print(srv.endpoint, srv.token_for("127.0.0.2:4000"), flush=True)
resource.setrlimit(resource.RLIMIT_NOFILE,
                   (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
held = []
try:
    while True:
        held.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
print("full", flush=True)
for line in sys.stdin:
    if line.strip() == "cpu":
        r = resource.getrusage(resource.RUSAGE_SELF)
        print(r.ru_utime + r.ru_stime, flush=True)
    elif line.strip() == "free":
        for fd in held:
            os.close(fd)
        print("freed", flush=True)
