"""Test worker: writes its PID to PID_DIR/rank<r>.pid, then never returns (the launcher must stop it)."""
import os
import sys
import time

pid_dir = sys.argv[1]
with open(os.path.join(pid_dir, f"rank{os.environ['RANK']}.pid"), "w") as f:
    f.write(str(os.getpid()))
while True:
    time.sleep(0.1)
