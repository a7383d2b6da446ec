"""The --verify checks, run from the slim tree with CUDA hidden and the GPU image's missing packages hidden:
import, backend, jit (programs.py), and with nvcc, deps (nvcc -M over every generated source) and compile."""
from __future__ import annotations

import fnmatch
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path

from superinfer_sgl.flashinfer_slim.common import log
from superinfer_sgl.flashinfer_slim.gpu_env import add_libcuda_stub, env_from_script, find_cuda_home
from superinfer_sgl.flashinfer_slim.programs import CHECK_BACKEND, CHECK_IMPORT, CHECK_JIT

# top-level modules the GPU image (torch 2.11 'cuda' image) does not have; hidden by the import check
ABSENT_ON_GPU = ("flashinfer", "flashinfer_python-*", "nvidia_cutlass_dsl*", "cudnn", "nvidia_cudnn_frontend*",
                 "cutile_cache", "cuda_tile*", "nccl", "nccl4py*", "nccl_extensions*", "flashinfer_jit_cache*",
                 "flashinfer_cubin*", "__pycache__")


def gpu_like_site(work: Path) -> Path:
    """A folder of links to this interpreter's site-packages minus what the GPU image lacks (and flashinfer)."""
    import site
    farm = work / "gpu_like_site"
    if farm.exists():
        shutil.rmtree(farm)
    farm.mkdir(parents=True)
    seen = set()
    for sp in [p for p in site.getsitepackages() if os.path.isdir(p)]:
        for e in sorted(os.listdir(sp)):
            if e in seen or e.endswith(".pth") or any(fnmatch.fnmatch(e, g) for g in ABSENT_ON_GPU):
                continue
            seen.add(e)
            if e == "cuda" and os.path.isdir(os.path.join(sp, "cuda")):  # namespace: drop cuda.tile only
                (farm / "cuda").mkdir()
                for c in os.listdir(os.path.join(sp, "cuda")):
                    if c != "tile":
                        os.symlink(os.path.join(sp, "cuda", c), farm / "cuda" / c)
                continue
            os.symlink(os.path.join(sp, e), farm / e)
    return farm



def run_check(name: str, code: str, args: list[str], python: str, pythonpath: list[Path], env_extra: dict,
              timeout: int = 900) -> tuple[bool, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(PYTHONPATH=os.pathsep.join(str(p) for p in pythonpath), CUDA_VISIBLE_DEVICES="",
               PYTHONDONTWRITEBYTECODE="1", **env_extra)
    t = time.time()
    # -S: no site-packages of this interpreter (nor its .pth hooks): only the slim tree + the GPU-like site
    r = subprocess.run([python, "-S", "-c", code, *args], env=env, capture_output=True, text=True,
                       timeout=timeout)
    ok = r.returncode == 0
    tail = (r.stdout if ok else r.stdout + r.stderr).strip().splitlines()
    log(f"[{name}] {'ok' if ok else 'FAILED'} ({time.time() - t:.1f}s): " + " | ".join(tail[-3:] if ok else tail[-25:]))
    return ok, r.stdout + r.stderr



def check_deps(jit_json: Path, slim_pkg: Path, full_pkg: Path | None, cuda_home: str, jobs: int) -> dict:
    """nvcc -M over every generated .cu: every header resolves, none outside the slim tree's package."""
    from concurrent.futures import ThreadPoolExecutor
    spec = json.loads(jit_json.read_text())
    cmds = []
    for name, m in spec["modules"].items():
        for c in m["commands"]:
            toks = shlex.split(c)
            src = toks[toks.index("-c") + 1]
            o = toks.index("-o")
            toks = [t for i, t in enumerate(toks) if i not in (o, o + 1)]
            toks[toks.index("-c")] = "-M"
            cmds.append((name, src, toks))
    slim_root = str(slim_pkg.resolve())
    full_root = str(full_pkg.resolve()) if full_pkg else None

    def one(item):
        name, src, toks = item
        r = subprocess.run(toks, capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            return name, src, None, r.stderr[-2000:]
        deps = r.stdout.replace("\\\n", " ").split()[1:]
        return name, src, [d for d in deps if not d.endswith(":")], None

    t = time.time()
    headers, errors, leaks = set(), [], []
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as ex:
        for name, src, deps, err in ex.map(one, cmds):
            if err is not None:
                errors.append(f"{Path(src).name}: {err}")
                continue
            for d in deps:
                rp = os.path.realpath(d)
                headers.add(rp)
                if full_root and rp.startswith(full_root + os.sep):
                    leaks.append(rp)
    in_slim = sum(1 for h in headers if h.startswith(slim_root + os.sep))
    res = {"sources": len(cmds), "errors": errors, "headers": len(headers), "headers_in_slim": in_slim,
           "from_full_package": sorted(set(leaks))[:20], "s": round(time.time() - t, 1)}
    log(f"[deps] {'ok' if not errors and not leaks else 'FAILED'} ({res['s']}s): {len(cmds)} sources "
        f"preprocessed, {len(headers)} distinct headers, {in_slim} from the slim tree" +
        (f"; errors: {errors[:2]}" if errors else "") + (f"; from the full package: {leaks[:3]}" if leaks else ""))
    return res


def check_compile(jit_json: Path, key: str, shape: str, cuda_home: str, jobs: int, work: Path) -> dict:
    spec = json.loads(jit_json.read_text())
    mods = [(n, m) for n, m in spec["modules"].items() if m["key"] == key and m["shape"] == shape]
    if not mods:
        raise SystemExit(f"--compile {key}: no such generated module for shape {shape}")
    name, m = mods[0]
    env = dict(os.environ, CUDA_HOME=cuda_home)
    ninja = Path(m["ninja"])
    t = time.time()
    r = subprocess.run(["ninja", "-C", str(ninja.parent), "-f", str(ninja), "-j", str(jobs)], env=env,
                       capture_output=True, text=True)
    secs = round(time.time() - t, 1)
    so = Path(m["so"])
    res = {"module": name, "key": key, "shape": shape, "jobs": jobs, "seconds": secs,
           "ok": r.returncode == 0 and so.exists(), "so": str(so),
           "so_mib": round(so.stat().st_size / 2**20, 2) if so.exists() else None,
           "sources": len(m["sources"])}
    if not res["ok"]:
        res["error"] = (r.stdout + r.stderr)[-3000:]
    log(f"[compile] {'ok' if res['ok'] else 'FAILED'}: {key} {shape} ({len(m['sources'])} sources, -j{jobs}) "
        f"{secs}s, .so {res['so_mib']} MiB" + ("" if res["ok"] else "\n" + res["error"]))
    return res


def verify(tree_dir: Path, full_pkg: Path | None, python: str, work: Path, modules: list[str], shapes: list[str],
           deps: bool, compile_key: str | None, jobs: int) -> dict:
    farm = gpu_like_site(work)
    path = [tree_dir, farm]
    ws = work / "jit_ws"
    env = {"FLASHINFER_WORKSPACE_BASE": str(ws), "FLASHINFER_CUDA_ARCH_LIST": "9.0"}
    cuda_home = find_cuda_home()
    if cuda_home:
        env["CUDA_HOME"] = cuda_home  # only read into the ninja files (cuda_home = ...)
    res = {}
    # the same environment the GPU gets: source the tree's flashinfer_gpu_env.sh (finds curand_kernel.h and
    # libcudart/libcuda for the link); a machine without the driver gets an empty libcuda.so stub to link with
    res["gpu_env"] = env_from_script(tree_dir / "flashinfer_gpu_env.sh", python, env)
    env.update({k: v for k, v in res["gpu_env"].items() if k != "PYTHONPATH"})
    if cuda_home:
        add_libcuda_stub(env, cuda_home, work)
    root = str((tree_dir / "flashinfer").resolve())
    res["import"], _ = run_check("import", CHECK_IMPORT, [root], python, path, env)
    if importlib.util.find_spec("sglang") is not None:
        res["backend"], _ = run_check("backend", CHECK_BACKEND, [root], python, path, env)
    else:
        log("[backend] skipped: sglang is not installed here")
    jit_json = work / "jit_specs.json"
    res["jit"], _ = run_check("jit", CHECK_JIT, [root, ",".join(modules), ",".join(shapes), str(jit_json)],
                              python, path, env)
    if res["jit"]:
        spec = json.loads(jit_json.read_text())
        res["jit_modules"] = {n: {"key": m["key"], "shape": m["shape"], "sources": len(m["sources"]),
                                  "aot": m["aot"]} for n, m in spec["modules"].items()}
        aot = [n for n, m in spec["modules"].items() if m["aot"]]
        if aot:
            log(f"[jit] {len(aot)} module(s) travel prebuilt (data/aot, loaded without compiling): {aot}")
    if (deps or compile_key) and not cuda_home:
        log("[deps/compile] skipped: no nvcc on this machine")
    elif deps and res["jit"]:
        d = check_deps(jit_json, tree_dir / "flashinfer", full_pkg, cuda_home, jobs)
        res["deps"] = not d["errors"] and not d["from_full_package"]
        res["deps_detail"] = d
    if compile_key and cuda_home and res["jit"]:
        key, _, shape = compile_key.partition("@")
        c = check_compile(jit_json, key, shape or shapes[0], cuda_home, jobs, work)
        res["compile"] = c["ok"]
        res["compile_detail"] = c
    return res

