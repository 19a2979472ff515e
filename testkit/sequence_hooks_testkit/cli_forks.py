# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`vllm` command lines run as the `vllm` command runs them, each in a
process of its own, with vLLM imported once for all of them.

For the tests of what `vllm serve` refuses before any engine starts, and
of its help: each would otherwise start an interpreter and import vLLM
(10 to 20 s on the CI machine) to run a second of the command. The
server (``python -m sequence_hooks_testkit.cli_forks``, in the venv of
the vLLM under test) imports the `vllm` command's `main` and what `main`
imports first in every release the suites run, before it reads any
argument; then, for each command line, it forks a child that does what
the `vllm` script does (``sys.exit(main())`` with the command line as
``sys.argv``), its output and errors to a file, or each to its own (an
uncaught exception's traceback as Python prints it), in a session of its
own. The server answers each command line with the child's exit status,
or none if it had to kill it (at its timeout: `ForkedCommands.run` then
fails), and kills whatever is left of the child's session. It forks from
one thread only, or fails (a fork copies the forking thread alone: a lock
another thread held would stay held in the child), so vLLM's import runs
with OpenBLAS told to start no thread of its own (the children get the
caller's environment). It stops, its running child killed, when its
standard input closes.

`ForkedCommands` is the test's side.
"""

import contextlib
import importlib
import inspect
import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

READY = "ready"
OPENBLAS_THREADS_ENV = "OPENBLAS_NUM_THREADS"


@dataclass(frozen=True)
class Finished:
    """A command line's end: its exit status, its output (and its errors,
    unless apart) and its errors apart."""

    returncode: int
    output: str
    errors: Optional[str]


class ForkedCommands:
    """The server, started in ``python``'s venv with ``env`` (the
    environment of every command line it runs); writes each command
    line's output in ``work_dir``. A context manager: stopped on leaving.
    """

    def __init__(self, python: str, env: dict, work_dir: Path) -> None:
        self.work_dir = work_dir
        self.count = 0
        self.log = work_dir / "cli_forks.log"
        with self.log.open("w") as log:
            self.process = subprocess.Popen(
                [python, "-m", "sequence_hooks_testkit.cli_forks"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=env)
        try:
            assert self._reply(600) == READY, self.log.read_text()[-3000:]
        except BaseException:
            self.process.kill()
            self.close()
            raise

    def __enter__(self) -> "ForkedCommands":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _reply(self, timeout_s: float) -> str:
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        line = self.process.stdout.readline() if ready else ""
        assert line, f"no answer from the server: {self.log.read_text()}"
        return line.strip()

    def run(self,
            args: list[str],
            timeout_s: float,
            errors_apart: bool = False) -> Finished:
        """Runs ``vllm *args`` in a child of the server.

        Args:
            args: The command line after ``vllm``.
            timeout_s: How long the command may run: the child (its whole
                session) is then killed, and the run fails.
            errors_apart: Its errors apart from its output; else with it,
                as `subprocess.STDOUT` puts them.

        Returns:
            The command's end: its exit status, output and errors.

        Raises:
            AssertionError: The command did not end within ``timeout_s``
                (the end of its output in the message), or the server did
                not answer.
        """
        self.count += 1
        out = self.work_dir / f"command-{self.count}.out"
        err = self.work_dir / f"command-{self.count}.err"
        self.process.stdin.write(
            json.dumps({
                "args": args,
                "out": str(out),
                "err": str(err) if errors_apart else None,
                "timeout_s": timeout_s
            }) + "\n")
        self.process.stdin.flush()
        returncode = json.loads(self._reply(timeout_s + 60))
        output = out.read_text()
        errors = err.read_text() if errors_apart else None
        assert returncode is not None, (
            f"vllm {' '.join(args)} did not end in {timeout_s} s (killed); "
            f"its output ends:\n{(output + (errors or ''))[-3000:]}")
        return Finished(returncode, output, errors)

    def close(self) -> None:
        """Stops the server: its standard input closed, it kills a running
        child and exits (killed if it has not within 30 s)."""
        # What a failed write left unsent cannot go.
        with contextlib.suppress(BrokenPipeError):
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        finally:
            self.process.stdout.close()


def _one_thread(before: str) -> None:
    """Fails, saying why, unless this process runs one thread only."""
    threads = len(os.listdir("/proc/self/task"))
    assert threads == 1, (
        f"{threads} threads {before}: a fork copies only the forking thread "
        "(a lock another one held would stay held in the child), so this "
        "server must run one")


def _kill_session(pid: int) -> None:
    """Kills what is left of the session child ``pid`` leads."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def _wait(pid: int, timeout_s: float) -> tuple[Optional[int], bool]:
    """Waits for child ``pid``, then kills what is left of its session.

    Args:
        pid: The child, the leader of its session.
        timeout_s: How long it may run.

    Returns:
        Its exit status (None if it had to be killed: at ``timeout_s``, or
        when the standard input closed), and whether the standard input
        closed while it ran (the test's side writes nothing meanwhile).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            _kill_session(pid)
            return os.waitstatus_to_exitcode(status), False
        closed = bool(select.select([sys.stdin], [], [], 0.05)[0])
        if closed or time.monotonic() > deadline:
            _kill_session(pid)
            os.waitpid(pid, 0)
            _kill_session(pid)
            return None, closed


# What the `vllm` command's `main` imports before it reads the command
# line, in the releases the suites run (0.9.2, 0.31 to 0.33), each where
# the release's `main` imports it: each child imports them again, as
# nothing.
MAIN_IMPORTS = [
    "vllm.entrypoints.cli.benchmark.main",
    "vllm.entrypoints.cli.collect_env",
    "vllm.entrypoints.cli.download_kernels",
    "vllm.entrypoints.cli.launch",
    "vllm.entrypoints.cli.openai",
    "vllm.entrypoints.cli.preload",
    "vllm.entrypoints.cli.run_batch",
    "vllm.entrypoints.cli.serve",
    "vllm.entrypoints.cli.snapshot",
]


def _serve() -> None:
    # The answers go where the output went; the output (vLLM logs to it)
    # to the errors' log.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    # OpenBLAS (numpy's, which vLLM imports) starts a thread a core as it
    # loads unless told one; the children get the caller's environment.
    caller_env = dict(os.environ)
    os.environ[OPENBLAS_THREADS_ENV] = "1"
    # The `vllm` script's import, then what its `main` imports first.
    from vllm.entrypoints.cli.main import main
    source = inspect.getsource(main)
    for name in MAIN_IMPORTS:
        if f"import {name}\n" in source:
            importlib.import_module(name)
    os.environ.clear()
    os.environ.update(caller_env)
    _one_thread("after vLLM's import")
    print(READY, file=answers, flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        _one_thread("before a fork")
        pid = os.fork()
        if pid == 0:
            # The child: the command, as the `vllm` script runs it. Its
            # exit (or an uncaught exception's) ends this process here.
            os.setsid()
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
            out = os.open(command["out"], flags)
            err = os.open(command["err"], flags) if command["err"] else out
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            os.dup2(out, 1)
            os.dup2(err, 2)
            sys.argv = ["vllm", *command["args"]]
            sys.exit(main())
        returncode, closed = _wait(pid, command["timeout_s"])
        if closed:
            return
        print(json.dumps(returncode), file=answers, flush=True)


if __name__ == "__main__":
    _serve()
