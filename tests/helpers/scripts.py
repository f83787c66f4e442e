"""A script of ``scripts/`` loaded as a module (tests/test_server.py, test_head_prompt_mix.py)."""

from __future__ import annotations


def load_script(name: str):
    """``scripts/NAME.py`` as a module (the scripts are not a package); its own folder on the path,
    for scripts that import a sibling."""
    import importlib.util
    import sys
    from pathlib import Path

    folder = Path(__file__).resolve().parents[2] / "scripts"
    if str(folder) not in sys.path:
        sys.path.append(str(folder))
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
