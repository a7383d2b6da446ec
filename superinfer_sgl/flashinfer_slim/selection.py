"""Which files of the FlashInfer package travel, the slim tree built from them, and its reproducible tar.xz."""
from __future__ import annotations

import fnmatch
import importlib.util
import json
import os
import shutil
import subprocess
import tarfile
import time
import zipfile
from pathlib import Path

from superinfer_sgl.flashinfer_slim.common import REPO, log
from superinfer_sgl.flashinfer_slim.gpu_env import GPU_ENV_SH

# data/ header trees the JIT include path names (flashinfer/jit/env.py, cpp_ext.py), kept whole
DATA_TREES = (
    "include",                       # FlashInfer's own headers (-isystem)
    "cutlass/include",               # CUTLASS + CuTe (fa3/hopper kernels) (-isystem)
    "cutlass/tools/util/include",    # (-isystem)
    "spdlog/include",                # (-isystem)
    "cccl/cub/cub",                  # vendored CCCL, -I before the toolkit's own copy
    "cccl/libcudacxx/include",
    "cccl/thrust/thrust",
)
# data/csrc: every top-level header and template (336 KiB), and the .cu files of the attention modules
CSRC_KEEP = ("*.h", "*.cuh", "*.inc", "*.jinja", "*.hpp")
CSRC_CU_KEEP = (
    "batch_decode*.cu", "batch_prefill*.cu", "single_decode*.cu", "single_prefill*.cu",
    "cascade.cu", "flashinfer_cascade_binding.cu", "page.cu", "flashinfer_page_binding.cu",
    # with FlashInfer importable SGLang's default --sampling-backend becomes "flashinfer" (sampling module), and
    # a few layers may pick FlashInfer's norm/rope/top-k: their sources travel too (~0.1 MiB), though
    # scripts/gpu_ab.sh should pass --sampling-backend pytorch to skip one more first-use build
    "sampling.cu", "renorm.cu", "flashinfer_sampling_binding.cu", "norm.cu", "flashinfer_norm_binding.cu",
    "rope.cu", "flashinfer_rope_binding.cu", "topk.cu", "cub_topk.cu", "flashinfer_topk_binding.cu",
    "flashinfer_fast_topk_clusters_binding.cu",
)
DIST_INFO_KEEP = ("METADATA", "WHEEL", "top_level.txt", "INSTALLER", "entry_points.txt")
# Python-side files that are not .py but are small and may be read at import time
PY_EXTRA_MAX_BYTES = 64 * 1024


def installed_package_dir() -> Path | None:
    spec = importlib.util.find_spec("flashinfer")  # finds without importing
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def source_from_wheel(wheel: Path, work: Path) -> Path:
    dst = work / "wheel"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(dst, [n for n in z.namelist() if n.startswith(("flashinfer/", "flashinfer_python-"))])
    return dst / "flashinfer"


def dist_info_for(pkg: Path) -> Path | None:
    hits = sorted(pkg.parent.glob("flashinfer_python-*.dist-info"))
    return hits[-1] if hits else None


def import_closure(pkg: Path, python: str) -> set[str]:
    """Files (relative to pkg) of the flashinfer modules that `import flashinfer` loads."""
    code = ("import sys, json, flashinfer; "
            "print(json.dumps([getattr(m, '__file__', None) for n, m in list(sys.modules.items()) "
            "if n == 'flashinfer' or n.startswith('flashinfer.')]))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(pkg.parent), os.environ.get("PYTHONPATH", "")]),
               CUDA_VISIBLE_DEVICES="", PYTHONDONTWRITEBYTECODE="1")
    out = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"`import flashinfer` failed in the full package:\n{out.stderr[-3000:]}")
    files = json.loads(out.stdout.strip().splitlines()[-1])
    root = pkg.resolve()
    rel = set()
    for f in files:
        if f:
            p = Path(f).resolve()
            if root in p.parents:
                rel.add(p.relative_to(root).as_posix())
    return rel


def select_files(pkg: Path, closure: set[str]) -> list[str]:
    """Relative paths (to pkg) of everything that travels."""
    keep: list[str] = []
    closure_dirs = {str(Path(r).parent) for r in closure}
    for root, dirs, files in os.walk(pkg):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        rroot = Path(root).relative_to(pkg).as_posix()
        if rroot == "data" or rroot.startswith("data/"):
            continue
        in_exp = rroot == "experimental" or rroot.startswith("experimental/")
        for f in files:
            rel = f"{rroot}/{f}" if rroot != "." else f
            if f.endswith(".py"):
                if in_exp and rel not in closure and not (f == "__init__.py" and rroot in closure_dirs):
                    continue
                keep.append(rel)
            elif not in_exp and not f.endswith((".cu", ".cuh", ".c", ".h", ".md")) \
                    and (pkg / rel).stat().st_size <= PY_EXTRA_MAX_BYTES:
                keep.append(rel)  # py.typed, small manifests
    data = pkg / "data"
    for tree in DATA_TREES:
        base = data / tree
        if not base.is_dir():
            raise FileNotFoundError(f"expected header tree missing from the package: {base}")
        for root, dirs, files in os.walk(base):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for f in files:
                keep.append((Path(root) / f).relative_to(pkg).as_posix())
    csrc = data / "csrc"
    for f in sorted(os.listdir(csrc)):
        p = csrc / f
        if p.is_file() and (any(fnmatch.fnmatch(f, g) for g in CSRC_KEEP)
                            or any(fnmatch.fnmatch(f, g) for g in CSRC_CU_KEEP)):
            keep.append(f"data/csrc/{f}")
    return sorted(set(keep))


def build_tree(pkg: Path, dst_root: Path, files: list[str], aot_from: Path | None) -> Path:
    """Copy the selection to dst_root/flashinfer (+ a trimmed dist-info); returns the package dir."""
    out_pkg = dst_root / "flashinfer"
    if out_pkg.exists():
        shutil.rmtree(out_pkg)
    for rel in files:
        d = out_pkg / rel
        d.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(pkg / rel, d)
    di = dist_info_for(pkg)
    if di is not None:
        out_di = dst_root / di.name
        if out_di.exists():
            shutil.rmtree(out_di)
        out_di.mkdir(parents=True)
        for f in DIST_INFO_KEEP:
            if (di / f).is_file():
                shutil.copy2(di / f, out_di / f)
    (dst_root / "flashinfer_gpu_env.sh").write_text(GPU_ENV_SH)
    if aot_from is not None:
        # a FlashInfer JIT cache (.../cached_ops/<name>/<name>.so) -> data/aot/<name>/<name>.so
        n = 0
        for so in sorted(Path(aot_from).rglob("*.so")):
            if so.stem == so.parent.name:
                d = out_pkg / "data" / "aot" / so.stem / so.name
                d.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(so, d)
                n += 1
        log(f"aot: {n} prebuilt module(s) from {aot_from}")
    return out_pkg


def write_tar_xz(dst_root: Path, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    names = sorted(p.name for p in dst_root.iterdir()
                   if p.name in ("flashinfer", "flashinfer_gpu_env.sh") or p.name.endswith(".dist-info"))
    xz = shutil.which("xz")
    if xz:  # multithreaded xz; tar stream written by Python (sorted, no owner names: reproducible)
        with open(tmp, "wb") as fh:
            proc = subprocess.Popen([xz, "-6", "-T0", "-c"], stdin=subprocess.PIPE, stdout=fh)
            with tarfile.open(fileobj=proc.stdin, mode="w|", format=tarfile.PAX_FORMAT) as tf:
                for n in names:
                    tf.add(dst_root / n, arcname=n, filter=_tar_filter)
            proc.stdin.close()
            if proc.wait() != 0:
                raise RuntimeError("xz failed")
    else:
        with tarfile.open(tmp, "w:xz", preset=6) as tf:
            for n in names:
                tf.add(dst_root / n, arcname=n, filter=_tar_filter)
    tmp.replace(out)


def _tar_filter(ti: tarfile.TarInfo):
    if "__pycache__" in ti.name:
        return None
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    return ti


def ensure_ignored(out: Path) -> None:
    """The bundle folder must never be committed: add it to .git/info/exclude when it is inside the repo."""
    try:
        rel = out.resolve().relative_to(REPO)
    except ValueError:
        return
    if subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q", str(rel)]).returncode == 0:
        return
    top = rel.parts[0]
    gitdir = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--git-dir"], capture_output=True,
                            text=True).stdout.strip()
    if not gitdir:
        return
    excl = (REPO / gitdir if not os.path.isabs(gitdir) else Path(gitdir)) / "info" / "exclude"
    excl.parent.mkdir(parents=True, exist_ok=True)
    with open(excl, "a") as fh:
        fh.write(f"/{top}/\n")
    log(f"added /{top}/ to {excl}")


def slim(src_pkg: Path, out: Path | None, tree_dir: Path, python: str,
         aot_from: Path | None = None) -> dict:
    t0 = time.time()
    closure = import_closure(src_pkg, python)
    files = select_files(src_pkg, closure)
    missing = sorted(c for c in closure if c not in set(files))
    if missing:
        raise RuntimeError(f"import closure not covered by the selection: {missing[:10]}")
    build_tree(src_pkg, tree_dir, files, aot_from)
    raw = sum((src_pkg / f).stat().st_size for f in files)
    info = {"source": str(src_pkg), "files": len(files), "raw_mib": round(raw / 2**20, 1),
            "import_closure_modules": len(closure), "tree": str(tree_dir)}
    vf = src_pkg / "_build_meta.py"
    if vf.exists():
        for line in vf.read_text().splitlines():
            if line.startswith("__version__"):
                info["version"] = line.split("=", 1)[1].strip().strip("\"'")
    if out is not None:
        write_tar_xz(tree_dir, out)
        info["out"] = str(out)
        info["xz_mib"] = round(out.stat().st_size / 2**20, 2)
    info["slim_s"] = round(time.time() - t0, 1)
    return info
