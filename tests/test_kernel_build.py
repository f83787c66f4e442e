"""The kernel built ahead of time (issue 64): a package build compiles instruction-set variants
(``models/kernel_build.py``, ``setup.py``), the library picks the best one the CPU runs, and an installed
wheel runs exactly on a machine with no compiler."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from leapdecode.errors import InvalidParameterError
from leapdecode.models import kernel_build, kernel_library, qkernel

ROOT = Path(__file__).resolve().parents[1]


NEEDS = {name: set(needs) for name, _, needs in kernel_build.VARIANTS}  # each variant's CPU flags


def _fake_prebuilt(tmp_path: Path, names=("amx", "avx512-vnni", "avx2-vnni", "avx2", "portable"), sources=None) -> Path:
    out = tmp_path / "prebuilt"
    out.mkdir()
    variants = {}
    for name, flags, needs in kernel_build.VARIANTS:
        if name in names:
            (out / f"qgemm-{name}.so").write_bytes(b"")
            variants[name] = {"file": f"qgemm-{name}.so", "cpu_flags": list(needs), "flags": list(flags)}
    (out / "manifest.json").write_text(json.dumps({"sources": sources or kernel_build.sources_digest(),
                                                   "variants": variants}))
    return out


def test_the_best_variant_the_cpu_runs_is_chosen(tmp_path):
    out = _fake_prebuilt(tmp_path)
    avx512, avx2 = NEEDS["avx512-vnni"], NEEDS["avx2"]
    assert kernel_build.best_variant(avx512 | {"amx_tile", "amx_int8"}, out) == ("amx", out / "qgemm-amx.so")
    assert kernel_build.best_variant(avx512 | {"amx_int8"}, out) == ("avx512-vnni", out / "qgemm-avx512-vnni.so")
    assert kernel_build.best_variant(avx512 - {"avx512_vnni"}, out)[0] == "avx2"  # AVX-512 without VNNI
    assert kernel_build.best_variant(avx2, out)[0] == "avx2"
    assert kernel_build.best_variant(avx2 | {"avx_vnni"}, out)[0] == "avx2-vnni"  # a laptop's AVX2 with AVX-VNNI
    assert kernel_build.best_variant(avx512 | {"avx_vnni"}, out)[0] == "avx512-vnni"
    assert kernel_build.best_variant({"sse2"}, out)[0] == "portable"
    assert kernel_build.best_variant(avx512, out, only="avx2")[0] == "avx2"
    assert kernel_build.best_variant(avx2, out, only="avx512-vnni") is None  # this CPU cannot run it
    (out / "qgemm-avx2.so").unlink()  # a variant's file missing: the next one
    assert kernel_build.best_variant(avx2, out)[0] == "portable"
    # best first: each variant needs more of the CPU than the plain AVX2 one
    assert NEEDS["avx512-vnni"] < NEEDS["amx"] and NEEDS["avx2"] < NEEDS["avx512-vnni"] and NEEDS["avx2"] < NEEDS["avx2-vnni"]


def test_prebuilt_variants_of_other_sources_or_none_are_not_used(tmp_path):
    flags = NEEDS["amx"]
    assert kernel_build.best_variant(flags, _fake_prebuilt(tmp_path, sources="0" * 64)) is None  # stale
    assert kernel_build.best_variant(flags, tmp_path / "nothing") is None  # a source checkout
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "manifest.json").write_text("{not json")
    assert kernel_build.best_variant(flags, tmp_path / "bad") is None


def test_leapdecode_kernel_picks_a_variant_or_the_native_build(tmp_path, monkeypatch):
    out = _fake_prebuilt(tmp_path)
    monkeypatch.setattr(kernel_build, "PREBUILT", out)
    monkeypatch.setattr(kernel_library, "cpu_flags", lambda: " ".join(NEEDS["avx512-vnni"]))
    monkeypatch.delenv(kernel_library.KERNEL_ENV, raising=False)
    assert kernel_library.prebuilt_variant()[0] == "avx512-vnni"
    monkeypatch.setenv(kernel_library.KERNEL_ENV, "avx2")
    assert kernel_library.prebuilt_variant()[0] == "avx2"
    monkeypatch.setenv(kernel_library.KERNEL_ENV, "native")
    assert kernel_library.prebuilt_variant() is None
    monkeypatch.setenv(kernel_library.KERNEL_ENV, "sse9")
    with pytest.raises(InvalidParameterError, match="LEAPDECODE_KERNEL='sse9'"):
        kernel_library.prebuilt_variant()


def test_a_prebuilt_variant_loads_and_gives_the_native_builds_bits(tmp_path, monkeypatch):
    # the AVX2 variant as a package build compiles it (x86-64-v3, not -march=native), chosen by the loader:
    # its ABI checks pass and a product of every code format gives the bits of the library built here
    if kernel_library.kernel_problem() is not None:
        pytest.skip(f"the kernel is not available here: {kernel_library.kernel_problem()}")
    cxx = kernel_library.compiler()
    if cxx is None or not NEEDS["avx2"] <= set(kernel_library.cpu_flags().split()):
        pytest.skip("no compiler, or a CPU that does not run the AVX2 variant")
    out = tmp_path / "prebuilt"
    manifest = kernel_build.build_prebuilt(cxx, out, say=lambda _: None, names=("avx2",))
    assert list(manifest["variants"]) == ["avx2"] and not any(p.name.startswith(".work") for p in out.iterdir())
    monkeypatch.setattr(kernel_build, "PREBUILT", out)
    monkeypatch.setenv(kernel_library.KERNEL_ENV, "avx2")
    lib = kernel_library.prebuilt_library()
    assert lib is not None and lib.ld_simd() == 2
    from helpers.kernels import FORMATS, random_block, random_x

    native = kernel_library.library()
    for bits, group, offset in FORMATS:
        part = qkernel.QPart.from_block(random_block(48, 128, bits, group, offset, seed=90))
        x = random_x(5, 128, seed=91)
        ys = []
        for library in (native, lib):
            y = torch.empty(5, 48, dtype=torch.float32)
            work = torch.empty(library.ld_work_bytes(128, group), dtype=torch.uint8)
            assert library.ld_qgemm(x.data_ptr(), 5, 128, 128, *part.pointers(), 48, None, y.data_ptr(), 48, 1, 1,
                                    work.data_ptr()) == 0
            ys.append(y)
        assert torch.equal(*ys), (bits, group)


@pytest.mark.integration
def test_a_wheel_installs_and_runs_exactly_without_a_compiler(tmp_path):
    """`pip wheel .` builds the variants; installed in a fresh venv and run with no compiler on PATH,
    `leapdecode generate --require-exact` runs on the prebuilt kernel and gives the tokens of this
    checkout's own build."""
    if kernel_library.kernel_problem() is not None or kernel_library.compiler() is None:
        pytest.skip("needs the kernel and a compiler here (to build the wheel)")
    import leapdecode

    lm = leapdecode.load("smollm2-135m")
    want = leapdecode.generate(lm, "def fib(n):", max_new_tokens=24).tokens
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LEAPDECODE_KERNEL", "PYTHONPATH"))}
    source = tmp_path / "source"  # a copy of what the build reads: its build/ folder stays out of the checkout
    for name in ("pyproject.toml", "setup.py", "README.md"):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__", "prebuilt"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "wheel"), str(source)], check=True, env=env, timeout=900)
    wheel = next((tmp_path / "wheel").glob("leapdecode-*.whl"))
    assert wheel.name.endswith("-py3-none-linux_x86_64.whl")  # a platform wheel: it holds x86-64 libraries
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    site = Path(subprocess.check_output([str(venv / "bin" / "python"), "-c",
                                         "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip())
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, env=env, timeout=300)
    # the dependencies from this environment (after the wheel's own package on the path)
    (site / "zz_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run_env = {"HOME": os.environ.get("HOME", str(tmp_path)), "PATH": str(venv / "bin")}  # no compiler on PATH
    if "LEAPDECODE_CACHE" in os.environ:
        run_env["LEAPDECODE_CACHE"] = os.environ["LEAPDECODE_CACHE"]
    cli = [str(venv / "bin" / "python"), "-m", "leapdecode.cli"]  # (--target installs no console scripts)
    proc = subprocess.run([*cli, "generate", "-m", "smollm2-135m", "--require-exact",
                           "--max-new-tokens", "24", "--json", "def fib(n):"], capture_output=True, text=True,
                          env=run_env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["tokens"] == want
    doctor = subprocess.run([*cli, "doctor", "--json"], capture_output=True, text=True,
                            env=run_env, timeout=600)
    report = json.loads(doctor.stdout)
    assert report["compiler"] is None and report["kernel"]["variant"].startswith("the package's prebuilt")
    assert str(site) in report["kernel"]["library"]


def test_kernels_command_reports_the_variants_and_builds_native_on_purpose(tmp_path, monkeypatch, capsys):
    # `leapdecode kernels`: every variant, best first, with whether this CPU runs it; `kernels build --native`
    # builds into the cache (again only with --force) and checks that the library loads
    from leapdecode import cli, kernels_cli
    from leapdecode.models import kernel_library

    if kernel_library.kernel_problem() is not None:
        pytest.skip(f"the kernel is not available here: {kernel_library.kernel_problem()}")
    flags = "sse2 " + " ".join(NEEDS["avx2"])  # an AVX2 CPU without AVX-512
    monkeypatch.setattr(kernel_library, "cpu_flags", lambda: flags)
    r = kernels_cli.report()
    assert [v["name"] for v in r["variants"]] == [n for n, _, _ in kernel_build.VARIANTS]
    runs = {v["name"]: v["runs_here"] for v in r["variants"]}
    assert runs == {"amx": False, "avx512-vnni": False, "avx2-vnni": False, "avx2": True, "portable": True}
    assert "avx512_vnni" in next(v for v in r["variants"] if v["name"] == "avx512-vnni")["missing_cpu_flags"]
    assert r["isa"] == kernel_library.kernel_isa()

    real = Path(kernel_library.library()._name)
    target = tmp_path / "cache" / "qgemm-test.so"
    built = []

    def fake_build(t: Path) -> None:  # the real library copied in, with its digest, as a build leaves it
        from leapdecode.models.store import write_digest
        t.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(real, t.with_suffix(".tmp"))
        write_digest(t.with_suffix(".tmp"), t)
        os.replace(t.with_suffix(".tmp"), t)
        built.append(t)

    monkeypatch.setattr(kernel_library, "cached_library_path", lambda: target)
    monkeypatch.setattr(kernel_library, "build_library", fake_build)
    args = cli.build_parser().parse_args(["kernels", "build", "--native"])
    assert args.func(args) == 0 and built == [target] and f"built {target}" in capsys.readouterr().out
    assert args.func(args) == 0 and built == [target]  # intact: not built again
    args = cli.build_parser().parse_args(["kernels", "build", "--native", "--force"])
    assert args.func(args) == 0 and built == [target, target]
    for bad, match in ((["--variants", "sse9", "--out", str(tmp_path)], "unknown variant sse9"),
                       (["--variants"], "needs --out"), (["--native", "--out", str(tmp_path)], "--out goes with")):
        with pytest.raises(InvalidParameterError, match=match):
            kernels_cli.cmd_kernels(cli.build_parser().parse_args(["kernels", "build", *bad]))
    with pytest.raises(SystemExit):  # --native or --variants: one of them
        cli.build_parser().parse_args(["kernels", "build"])
