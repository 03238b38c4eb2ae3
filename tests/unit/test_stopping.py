"""SIGTERM raises Ctrl-C's exception in the main thread, once; ray.init keeps raylane's handler."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

PROGRAM = textwrap.dedent(
    """
    import os, signal, time
    from raylane.cli import stopping

    stopping.stop_on_sigterm()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        print("not raised")
    except KeyboardInterrupt as exc:  # Ctrl-C's handlers catch it
        print(type(exc).__name__, stopping.terminated(), stopping.stopped_by(exc))
        os.kill(os.getpid(), signal.SIGTERM)  # a second one while cleaning up: ignored
        time.sleep(0.2)
        print("clean-up finished")
    """
)


def test_sigterm_raises_terminated_once_and_is_told_apart_from_ctrl_c():
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["Terminated True SIGTERM", "clean-up finished"]


def test_stopped_by_names_ctrl_c_when_no_sigterm_came():
    from raylane.cli.stopping import stopped_by, terminated

    assert not terminated()
    assert stopped_by(KeyboardInterrupt()) == "Ctrl-C"


def test_the_handler_before_ray_init_is_the_one_after_it():
    from raylane.runtime import _sigterm_kept

    def mine(signum, frame):
        pass

    saved = signal.signal(signal.SIGTERM, mine)
    try:
        with _sigterm_kept():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # what ray.init's own handler does
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, saved)
