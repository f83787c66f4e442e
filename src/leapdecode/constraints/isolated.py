"""JSON schemas checked beside decoding, not in its way: a child process with a time budget.

``grammar.check_json_schema`` runs jsonschema's metaschema check, pure Python that holds the
interpreter lock: a schema of 20,000 properties took 6-9 s on 2 cores, during which a server's
decoding ran 2.8x slower (measured: a 64-token greedy generation of smollm2-135m, 0.62 s alone,
1.77 s beside a thread checking such schemas; probe HR22).  ``SchemaChecker`` runs that check in a
light child (``schema_check.py``: jsonschema only), kills it when a check runs past its budget
(and starts another for the next request), and records a valid schema in ``grammar.CHECKED``, so
that the request's validation and compilation in this process find it checked and do not check it
again.  The grammar engine's own compilation (Rust, which releases the lock) stays in this process,
under its own budget (``grammar.compile_constraint``).
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from ..errors import GrammarError
from .grammar import COMPILE_TIMEOUT_S, check_json_schema

CHILD = Path(__file__).with_name("schema_check.py")
# seconds a new child may take to start (its interpreter and jsonschema imported, at a lower priority:
# seconds on a loaded machine of few cores); not part of any check's budget.  A bound far above an idle
# start (0.18 s to its ready line and exit, 2-core Xeon VM, 2026-12-07); the 60 s themselves not measured
STARTUP_S = 60.0


class SchemaChecker:
    """Checks schemas in a child process, one at a time, each within ``timeout_s`` seconds
    (``what``: the setting that changes it, named in the error)."""

    def __init__(self, timeout_s: float = COMPILE_TIMEOUT_S, what: str = "") -> None:
        self.timeout_s, self.what = float(timeout_s), what
        self.checks = 0  # schemas sent to the child (tests: nothing checked in this process)
        self._child: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def check(self, schema: Any) -> dict:
        """``schema`` checked against its metaschema (``grammar.check_json_schema``, its rules and
        errors, with the check itself in the child), as a mapping; a valid one is remembered."""
        return check_json_schema(schema, self._in_child)

    def _in_child(self, schema: dict) -> None:
        line = (json.dumps({"schema": schema}) + "\n").encode()
        with self._lock:
            self.checks += 1
            reply = self._ask(line)
        if reply.get("deep"):
            raise GrammarError("the JSON schema is nested too deeply to check")
        if "error" in reply:
            raise GrammarError(f"invalid JSON schema at {reply['at']}: {reply['error']}")

    def _ask(self, line: bytes) -> dict:
        child = self._start()
        try:
            child.stdin.write(line)
            child.stdin.flush()
            ready, _, _ = select.select([child.stdout], [], [], self.timeout_s)
            answer = child.stdout.readline() if ready else None
        except OSError:  # the child died (killed from outside, out of memory): the next call starts another
            answer = b""
        if answer is None:
            self.close()
            setting = f" ({self.what})" if self.what else ""
            raise GrammarError(f"the JSON schema took more than {self.timeout_s:g} s to check{setting}; simplify it")
        if not answer:
            self.close()
            raise RuntimeError("the JSON schema checker's process stopped")
        return json.loads(answer)

    def _start(self) -> subprocess.Popen:
        """The child, started if need be and waited for until it says it is ready (``STARTUP_S``), so
        that a check's budget counts the check alone."""
        if self._child is None or self._child.poll() is not None:
            # -I: no user site, no PYTHONPATH, no script directory: jsonschema from this interpreter's own
            self._child = child = subprocess.Popen([sys.executable, "-I", str(CHILD)], stdin=subprocess.PIPE,
                                                   stdout=subprocess.PIPE, bufsize=0)
            ready, _, _ = select.select([child.stdout], [], [], STARTUP_S)
            if not ready or not json.loads(child.stdout.readline() or b"{}").get("ready"):
                self.close()
                raise RuntimeError(f"the JSON schema checker's process did not start within {STARTUP_S:g} s")
        return self._child

    def close(self) -> None:
        child, self._child = self._child, None
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
