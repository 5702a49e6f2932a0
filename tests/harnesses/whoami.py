"""A harness that imports nothing beyond ``json`` and ``os`` (a forked ``--preload`` run as another user reads no
module file it cannot reach) and writes, to ``input["probe_out"]``, who it runs as and whether it reads
``/proc/<input["peer"]>/environ`` and ``input["private_file"]``, and which descriptors above stderr it was given."""

import json
import os


def readable(path):
    try:
        with open(path, "rb") as f:
            f.read(1)
        return True
    except OSError:
        return False


def open_fds():
    """Descriptors above stderr this run holds (before it opens anything itself)."""
    found = []
    for fd in range(3, 1024):
        try:
            os.fstat(fd)
        except OSError:
            continue
        found.append(fd)
    return found


fds = open_fds()
task = json.loads(os.environ["AGL_INPUT"])
with open(task["probe_out"], "w") as f:
    json.dump({"uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(), "home": os.environ.get("HOME"),
               "user": os.environ.get("USER"), "peer_environ": readable(f"/proc/{task['peer']}/environ"),
               "private_file": readable(task["private_file"]), "fds": fds}, f)
