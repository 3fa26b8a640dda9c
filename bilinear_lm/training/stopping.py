"""A graceful stop: SIGTERM (schedulers, `timeout`, preemption, `kill`) and SIGINT (Ctrl-C) end a training run at the
next step boundary, after a checkpoint, every rank at the same step; one line naming the checkpoint, and the exit
status 128 + the signal's number (143, 130), as if the signal had ended the process. No traceback.

    with StopOnSignal() as stop:          # the handlers are installed (from the main thread) until the block ends
        ...                               # a signal outside the training steps raises Stopped at once
        stop.defer()                      # the training loop: a signal only sets a flag ...
        for step in ...:
            signum = stop.requested(accelerator)   # ... read at each step's end, agreed across ranks
            if signum: save a checkpoint; return stop.stopped(accelerator, signum, step, checkpoint)
        stop.undefer()

A SIGINT while a stop is pending (Ctrl-C again, or after a SIGTERM) ends the process at once (the signal's default
action). A SIGTERM then is the same request and is ignored: Slurm signals every process of a job step and torchrun
(`accelerate launch --multi_gpu`) forwards the SIGTERM it gets to its workers, so a worker can get two, and
`accelerate launch` of one process (accelerate >= 1.16) answers a Ctrl-C, which reaches train.py too, by sending it
SIGTERM (and SIGKILL 5 s later). After a SIGTERM, SIGKILL is the way to stop at once.
"""
from __future__ import annotations

import signal
import sys
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopped(BaseException):
    """The run stopped for a signal. Its exit status is 128 + the signal's number. A BaseException, like
    KeyboardInterrupt, so that no `except Exception` on its way up holds it back."""

    def __init__(self, signum: int, message: str, printed: bool = False):
        super().__init__(message)
        self.signum, self.printed = signum, printed  # printed: the main process wrote the message already

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _name(signum: int) -> str:
    return signal.Signals(signum).name


class StopOnSignal:
    """SIGTERM and SIGINT handlers for the length of a `with` block (installed only from the main thread, where
    Python runs handlers; the previous ones are restored after). See the module's docstring."""

    def __init__(self):
        self.signum = 0          # the first signal received (0: none)
        self.deferred = False    # in the training loop: the signal waits for the step's end
        self._previous = {}

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        return self

    def __exit__(self, *exc) -> bool:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        return False

    def _handle(self, signum: int, frame) -> None:
        if self.signum:  # a second signal: a SIGINT at once, a SIGTERM is the same request
            if signum == signal.SIGINT:
                signal.signal(signum, signal.SIG_DFL)
                signal.raise_signal(signum)
            return
        self.signum = signum
        if not self.deferred:
            raise Stopped(signum, f"stopped by {_name(signum)} outside the training steps (no checkpoint saved)")

    def defer(self) -> None:
        """From now on a signal only sets the flag that `requested` reads at each step's end."""
        self.deferred = True

    def undefer(self) -> None:
        """The training loop ended: a signal that came after its last step's check stops the run now."""
        self.deferred = False
        if self.signum:
            raise Stopped(self.signum, f"stopped by {_name(self.signum)} after the last training step (no checkpoint "
                                       f"saved; the last one is kept)")

    def requested(self, accelerator) -> int:
        """The signal every rank stops for at this step's end (0: go on): the largest of the ranks' flags, so that
        all stop at the same step even when the signal reached them at different steps (or one rank only). One
        gather of an int per optimizer step; none in a single process."""
        if accelerator.num_processes == 1:
            return self.signum
        import torch

        return int(accelerator.gather(torch.tensor([self.signum], device=accelerator.device)).max().item())

    @staticmethod
    def stopped(accelerator, signum: int, step: int, checkpoint) -> Stopped:
        """The Stopped of a run that saved `checkpoint` at `step`, its one line written to stderr by the main
        process."""
        message = (f"stopped by {_name(signum)} at step {step}: saved the checkpoint {checkpoint}; continue with "
                   f"--resume_from_checkpoint latest")
        if accelerator.is_main_process:
            sys.stderr.write(f"{message}\n")
            sys.stderr.flush()
        return Stopped(signum, message, printed=True)
