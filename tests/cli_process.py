"""`onboard` in a process of its own, forked from one interpreter that has done the imports.

A fresh interpreter spends about 7 s importing torch, transformers and llm-compressor before the
CLI reads its first argument, and a dozen tests that need a real process (its own exit status,
stdout and stderr, a SIGKILL, a file-size limit) paid that each. The server here imports them
once per test session (per xdist worker); each run forks a child that takes the run's argv,
environment, working directory and limits, points fds 1 and 2 at files, and calls
`onboard.cli.main()` as the console script does. The child is a real process: it exits with
the CLI's own status and can be killed. `tests/test_cli_errors.py::test_console_script_matches_batch`
checks that the installed script in a fresh interpreter says what a forked child says.

The server itself never runs a torch operation, so no thread pool exists when it forks.
"""

import json
import os
import select
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

SERVER = r"""
import json, os, resource, runpy, signal, sys, traceback
import onboard.cli
# The heavy imports, once, before forking.
import onboard.adapt.stage, onboard.evaluate.stage, onboard.quantize.stage, onboard.speculator.stage

def child(request):
    code = 1
    try:
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        if request["file_size_limit"] is not None:
            limit = request["file_size_limit"]
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() fails with EFBIG instead
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        sys.argv = [request["program"], *request["args"]]
        try:
            if request["program"] == "onboard":
                onboard.cli.main()
            else:  # a Python script, run as `python SCRIPT ARGS...` runs it
                sys.path.insert(0, os.path.dirname(os.path.abspath(request["program"])))
                runpy.run_path(request["program"], run_name="__main__")
            code = 0
        except SystemExit as done:
            if done.code is None or isinstance(done.code, int):
                code = done.code or 0
            else:
                print(done.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

for line in sys.stdin:
    request = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        sys.stdin.close()
        child(request)
    print(json.dumps({"pid": pid}), flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)
"""


@dataclass
class Finished:
    """What `subprocess.run(..., capture_output=True, text=True)` would have returned."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str


class Running:
    """A forked `onboard` child: its pid, and its end once the server has reaped it."""

    def __init__(self, server: "CliServer", args: list[str], stdout: Path, stderr: Path, pid: int):
        self.server, self.args, self.pid = server, args, pid
        self.stdout_path, self.stderr_path = stdout, stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self.server.ready():
            self.returncode = self.server.read()["returncode"]
        return self.returncode

    def wait(self) -> Finished:
        if self.returncode is None:
            self.returncode = self.server.read()["returncode"]
        self.server.busy = False
        return Finished(self.args, self.returncode, self.stdout_path.read_text(), self.stderr_path.read_text())


class CliServer:
    """One warm interpreter forking `onboard` runs, one at a time."""

    def __init__(self, logs: Path, env: dict[str, str]):
        self.logs, self.count, self.busy, self.pending = logs, 0, False, b""
        self.process = subprocess.Popen(
            [sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )

    def ready(self) -> bool:
        """Whether the server has said something that was not read yet."""
        return b"\n" in self.pending or bool(select.select([self.process.stdout], [], [], 0)[0])

    def read(self) -> dict:
        """The server's next line (unbuffered reads: `ready` must see everything not yet read)."""
        while b"\n" not in self.pending:
            chunk = os.read(self.process.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError(f"the onboard CLI server ended (status {self.process.poll()})")
            self.pending += chunk
        line, _, self.pending = self.pending.partition(b"\n")
        return json.loads(line)

    def start(
        self,
        args: list[str | Path],
        *,
        program: str | Path = "onboard",
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        file_size_limit: int | None = None,
    ) -> Running:
        """Fork `onboard ARGS` (or `python PROGRAM ARGS`) and return at once. `env`: the child's
        whole environment (default: this process's)."""
        assert not self.busy, "one run at a time: wait for the last one first"
        self.count += 1
        argv = [str(a) for a in args]
        stdout, stderr = self.logs / f"{self.count}.out", self.logs / f"{self.count}.err"
        request = {
            "program": str(program),
            "args": argv,
            "env": dict(os.environ if env is None else env),
            "cwd": str(cwd or Path.cwd()),
            "file_size_limit": file_size_limit,
            "stdout": str(stdout),
            "stderr": str(stderr),
        }
        self.process.stdin.write(json.dumps(request).encode() + b"\n")
        self.process.stdin.flush()
        self.busy = True
        return Running(self, argv, stdout, stderr, self.read()["pid"])

    def run(self, args: list[str | Path], **kwargs) -> Finished:
        """`onboard ARGS` (or `python PROGRAM ARGS`) in a forked child, to its end."""
        return self.start(args, **kwargs).wait()

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)
