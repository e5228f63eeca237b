"""Run ``megatron-pp-ext ARGS`` as ``python -m megatron_pp_ext ARGS`` does, without its start-up.

A fresh interpreter spends about 10 s of CPU on this machine importing torch and megatron-core
before the command reads its first flag. Here the command runs in a child forked from
``dist_utils``' forkserver, which imported them once: the same ``__main__`` (``runpy``), its own
process, working directory, environment, exit status and output streams (file descriptors 1 and
2, so its own child processes write there too). What it cannot show is a fresh interpreter's own
start: megatron-core's import warnings and ``quiet.py``'s filters, a signal sent to the command,
a reader that goes away; the tests of those keep ``subprocess``.
"""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

from dist_utils import warm_context


def _command(
    args: list[str], env: dict[str, str] | None, cwd: str | None, out: str, err: str, status: str
) -> None:
    if cwd is not None:
        os.chdir(cwd)
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_TRUNC), fd)
    sys.argv = ["megatron-pp-ext", *args]
    try:
        runpy.run_module("megatron_pp_ext", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as done:  # as the interpreter ends: None is 0, a message is printed and 1
        if done.code is None or isinstance(done.code, int):
            code = done.code or 0
        else:
            print(done.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    with open(status, "w") as handle:  # the forkserver may lose the status under load (it says 255)
        handle.write(str(code))
    os._exit(code)


def run_cli(
    args: Sequence[str],
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess:
    """``subprocess.run([python, -m, megatron_pp_ext, *args], capture_output=True, text=True)``."""
    args = [str(arg) for arg in args]
    with tempfile.TemporaryDirectory(prefix="cli-") as scratch:
        out, err = os.path.join(scratch, "stdout"), os.path.join(scratch, "stderr")
        status = os.path.join(scratch, "status")
        for path in (out, err):
            open(path, "w").close()
        process = warm_context().Process(
            target=_command,
            args=(
                args,
                None if env is None else dict(env),
                None if cwd is None else str(cwd),
                out,
                err,
                status,
            ),
            daemon=False,
        )
        process.start()
        process.join(timeout)
        if process.exitcode is None:
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired(["megatron-pp-ext", *args], timeout)
        code = process.exitcode
        if os.path.exists(status):  # the command's own status, as it exited
            with open(status) as handle:
                code = int(handle.read())
        with open(out) as stdout, open(err) as stderr:
            return subprocess.CompletedProcess(["megatron-pp-ext", *args], code, stdout.read(), stderr.read())


def run_main(capsys: Any, argv: Sequence[str]) -> tuple[int, str, str]:
    """``megatron-pp-ext ARGV`` in this process (fast; for commands that start no ranks):
    (exit status, stdout, stderr), stderr and stdout as ``capsys`` caught them."""
    from megatron_pp_ext.cli import main

    try:
        code = main(list(argv))
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err
