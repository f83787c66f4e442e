"""A child process that checks JSON schemas against their metaschemas (``isolated.SchemaChecker``).

jsonschema's check is pure Python: a schema of 20,000 properties takes 6-9 s here and holds the
interpreter lock all along, which slowed a server's decoding 2.8x (probe HR22; lab notes).  The
server runs it in this process instead, which imports jsonschema and nothing of leapdecode (run as a
script by its path, so the package, torch among it, is never imported: a light child).

Protocol: once started (jsonschema imported), ``{"ready": true}`` on stdout; then one JSON object a
line on stdin, ``{"schema": ...}``, and one line back per request:
``{"ok": true}``, ``{"error": MESSAGE, "at": PATH}`` (the metaschema's complaint) or
``{"deep": true}`` (nested too deeply to check).  The parent owns the time budget of a check (the
start-up is not part of it): it kills this process when a check runs past it.  It runs at a lower priority (``NICE``), so that on a machine of
few cores a check takes the CPU decoding leaves, not the other way round.  Keep the check itself in
step with ``grammar.metaschema_check`` (this child cannot import it: that would import leapdecode).
"""

import json
import os
import sys

NICE = 10  # below the server's decoding threads: on a machine of few cores the check yields the CPU to them


def check(schema):
    import jsonschema

    try:
        # structure only, as grammar.metaschema_check: no format checks
        jsonschema.validators.validator_for(schema).check_schema(schema, format_checker=None)
    except jsonschema.SchemaError as e:
        return {"error": e.message, "at": "/".join(str(p) for p in e.absolute_path) or "(root)"}
    except RecursionError:
        return {"deep": True}
    return {"ok": True}


def main():
    try:
        os.nice(NICE)
    except OSError:
        pass
    check({})  # jsonschema imported (and its check run once) before any request's budget starts

    sys.stdout.write(json.dumps({"ready": True}) + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        try:
            reply = check(json.loads(line)["schema"])
        except RecursionError:
            reply = {"deep": True}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
