import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# In a fresh interpreter: this test process may already run a fork server started with
# other preloads (tests/dist_helpers.py sets its own).
PROBE = """
import signal
from knapformer.local.local_world import worker_context

def probe(queue):
    queue.put(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)

if __name__ == "__main__":
    ctx = worker_context(preload=["knapformer.plan"])
    queue = ctx.Queue()
    worker = ctx.Process(target=probe, args=(queue,))
    worker.start()
    print(queue.get(timeout=60))
    worker.join()
    print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)
"""


def test_workers_start_with_ctrl_c_ignored_and_the_parent_keeps_it(tmp_path):
    # A terminal's Ctrl-C reaches the workers too; one still bootstrapping must not die
    # with a traceback, so they ignore SIGINT from birth, while the parent still gets it.
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    out = subprocess.run(
        [sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"], out.stdout + out.stderr
