"""What tests/runtime/cli/test_forkserver.py forks: reports what it was given
(argv, working directory, one variable, its cores, its parent's modules),
then exits with the code its first argument names, or, given "wait", waits
for a signal."""

import os
import signal
import sys
import time

print("argv", sys.argv[1:])
print("cwd", os.getcwd())
print("env", os.environ.get("FORKSERVER_CHILD_VALUE"))
print("cpus", sorted(os.sched_getaffinity(0)))
print("torch loaded", "torch" in sys.modules)
if sys.argv[1] == "wait":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print("waiting", flush=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.05)
elif sys.argv[1] == "message":
    sys.exit("told to fail")
sys.exit(int(sys.argv[1]))
