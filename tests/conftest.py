import os
import signal
import sys
import time

# One intra-op thread in this process and in every script, worker and rank the tests start (they inherit the
# environment). The CI machine has 2 cores shared by all of them: with torch's default of one OpenMP thread per core,
# every parallel op waits for a thread descheduled by a neighbour, and under load a 15 s toy run took over 600 s.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Every process started from this session carries this mark, so a leftover one can be found after each test.
SESSION_MARK = f"RL_TESTS_SESSION={os.getpid()}"
os.environ["RL_TESTS_SESSION"] = str(os.getpid())

import pytest  # noqa: E402
import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: runs a script for real (training, processes, simulators); `-m 'not slow'` leaves it out"
    )


# Tests run on the CPU always and on CUDA when a GPU is present.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"))]


def _marked_processes():
    """{pid: command line} of the live processes started from this test session, except pytest and the helpers that
    multiprocessing keeps for pytest itself (its resource tracker and forkserver live as long as the session)."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if SESSION_MARK.encode() not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if state == "Z" or (int(ppid) == os.getpid() and ("resource_tracker" in cmdline or "forkserver" in cmdline)):
            continue
        found[int(name)] = cmdline
    return found


@pytest.fixture(autouse=True)
def no_process_left_behind(request):
    """DEVELOPERS.md: no test leaves a process behind. After each test, every process it started must be gone within
    30 s (exiting runs flush and join their workers); any left is killed and the test errors with its command line."""
    yield
    if sys.platform != "linux":
        return
    deadline = time.monotonic() + 30
    while (left := _marked_processes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    assert not left, f"{request.node.name} left processes behind: {left}"
