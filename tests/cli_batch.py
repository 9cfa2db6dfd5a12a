"""Many `python -m kvcompress ARGS` (or `python SCRIPT ARGS`) runs for one interpreter start (tests' run_cli_batch): this process imports what the CLI
imports, then forks one child per run, which executes kvcompress/__main__.py as `python -m kvcompress` does (runpy, run_name
"__main__", sys.argv set) with its stdout and stderr in files, its exit code as the interpreter would give it (SystemExit's
code; an uncaught exception's traceback on stderr and 1). Each child starts from the same freshly imported state, never
from another run's: only the imports are shared, which is most of a short run's time (torch, transformers, hydra).

Input (stdin, JSON): [{"args": [...], "script": "<path>" or absent, "env": {...}, "out": "<file>", "err": "<file>"}, ...]. Output (stdout, JSON): the exit codes."""
from __future__ import annotations

import json
import os
import runpy
import sys
import traceback


def child(case: dict) -> int:
    for fd, path in ((1, case["out"]), (2, case["err"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    os.environ.update(case.get("env") or {})
    script = case.get("script")
    sys.argv = [script or "kvcompress", *case["args"]]
    code = 0
    try:
        if script:  # python SCRIPT ARGS: the script's directory first on sys.path
            sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
            runpy.run_path(script, run_name="__main__")
        else:
            runpy.run_module("kvcompress", run_name="__main__", alter_sys=True)
    except SystemExit as e:  # what the interpreter does with it
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def main() -> None:
    cases = json.load(sys.stdin)
    import hydra  # noqa: F401  (the CLI's imports, once: not kvcompress.__main__ itself, which each child runs as __main__)
    import transformers  # noqa: F401

    import kvcompress.pipeline  # noqa: F401

    codes = []
    for case in cases:
        pid = os.fork()
        if pid == 0:
            os._exit(child(case))
        codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    print(json.dumps(codes))


if __name__ == "__main__":
    main()
