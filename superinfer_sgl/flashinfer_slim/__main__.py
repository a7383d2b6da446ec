"""Slim FlashInfer to what SGLang 0.5.23's FlashInfer attention backend JIT-builds on Hopper, so it can travel.

Usage (repo root; M=superinfer_sgl.flashinfer_slim; `scripts/slim_flashinfer.py` takes the same options):
  .venv/bin/python -m $M                    # -> .gpu_bundle/flashinfer.tar.xz
  .venv/bin/python -m $M --wheel /tmp/fi/flashinfer_python-0.7.2-py3-none-any.whl
  .venv/bin/python -m $M --verify           # + the CPU checks below
  .venv/bin/python -m $M --verify --deps    # + nvcc -M over every generated source
  .venv/bin/python -m $M --verify --compile decode@bf16:128  # + one real sm_90a build, timed
  (GPU, project installed) . $FI/flashinfer_gpu_env.sh && python3 -m $M --warm --modules fa2_prefill,fa3_prefill,cascade
  (CPU, AOT) .venv/bin/python -m $M --no-tar --tree /tmp/fi_slim
        FLASHINFER_WORKSPACE_BASE=/tmp/fi_aot FI_PYTHON=.venv/bin/python bash -c '. /tmp/fi_slim/flashinfer_gpu_env.sh
          && .venv/bin/python -m $M --warm --modules fa2_prefill,fa3_prefill,cascade'
        .venv/bin/python -m $M --aot-from /tmp/fi_aot/.cache/flashinfer/0.7.2/90a/cached_ops
Checks (--verify; no GPU needed, CUDA hidden):
  import    `import flashinfer` from the slim tree, with the packages the GPU image lacks hidden
            (nvidia-cutlass-dsl, nvidia-cudnn-frontend, cuda-tile, nccl4py);
  backend   SGLang's flashinfer_backend imports against it (is_flashinfer_available forced on);
  jit       the JIT generators of the modules above write their sources and build.ninja for sm_90a
            (FLASHINFER_CUDA_ARCH_LIST=9.0) from the slim tree alone;
  deps      (--deps, needs nvcc) every generated .cu preprocesses (nvcc -M) with the ninja flags: every
            header resolves, and none comes from the full package;
  compile   (--compile MODULE, needs nvcc) ninja builds that module for sm_90a from the slim tree (-lcuda is
            satisfied by a stub when the machine has no driver), reporting seconds and the .so size.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from superinfer_sgl.flashinfer_slim.checks import verify
from superinfer_sgl.flashinfer_slim.common import DEFAULT_MAX_MIB, DEFAULT_OUT, log
from superinfer_sgl.flashinfer_slim.gpu_env import add_libcuda_stub, find_cuda_home
from superinfer_sgl.flashinfer_slim.programs import JIT_MODULES, WARM
from superinfer_sgl.flashinfer_slim.selection import ensure_ignored, installed_package_dir, slim, source_from_wheel


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--wheel", type=Path, help="a flashinfer_python-*.whl (default: the installed package)")
    src.add_argument("--src", type=Path, help="a flashinfer package folder (default: the installed one)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"tar.xz to write (default {DEFAULT_OUT})")
    ap.add_argument("--no-tar", action="store_true", help="only build the tree (with --tree)")
    ap.add_argument("--tree", type=Path, help="keep the slim tree here (default: a temp folder)")
    ap.add_argument("--max-mib", type=float, default=DEFAULT_MAX_MIB, help="fail above this .tar.xz size")
    ap.add_argument("--aot-from", type=Path, help="a FlashInfer JIT cache whose compiled <name>/<name>.so "
                    "travel as AOT modules (data/aot)")
    ap.add_argument("--verify", action="store_true", help="run the CPU checks (import, backend, jit)")
    ap.add_argument("--modules", default=",".join(JIT_MODULES), help="JIT modules to generate in --verify")
    ap.add_argument("--shapes", default="bf16:128,bf16:64",
                    help="dtype:head_dim list (Llama-3-8B: bf16:128; SmolLM2: bf16:64)")
    ap.add_argument("--deps", action="store_true", help="with --verify: nvcc -M over every generated source")
    ap.add_argument("--compile", metavar="MODULE[@dtype:hd]",
                    help="with --verify: build one module for sm_90a here, e.g. decode@bf16:128")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--python", default=sys.executable, help="interpreter for the checks (has torch, sglang)")
    ap.add_argument("--json", type=Path, help="write the report here too")
    ap.add_argument("--reuse-tree", action="store_true", help="with --tree: skip slimming if the tree exists")
    ap.add_argument("--keep-work", action="store_true", help="keep the temp folder (JIT workspace, build)")
    ap.add_argument("--warm", action="store_true",
                    help="GPU machine: build the --modules for --shapes now, in parallel (FlashInfer from PYTHONPATH, "
                    "i.e. the unpacked slim tree after sourcing flashinfer_gpu_env.sh), and load them; prints JSON")
    a = ap.parse_args()
    if a.warm:
        mods = a.modules if a.modules != ",".join(JIT_MODULES) else "decode,fa2_prefill,fa3_prefill,cascade"
        env = dict(os.environ)
        cuda_home = env.get("CUDA_HOME") or find_cuda_home()
        if cuda_home:
            env["CUDA_HOME"] = cuda_home
            # CPU machine (building AOT modules with --aot-from afterwards): stub libcuda if the driver is absent
            stub_dir = Path(env.get("FLASHINFER_WORKSPACE_BASE", tempfile.gettempdir())) / ".slim_fi_stub"
            add_libcuda_stub(env, cuda_home, stub_dir)
        return subprocess.run([a.python, "-c", WARM, mods, a.shapes], env=env).returncode

    work = Path(tempfile.mkdtemp(prefix="slim_fi_"))
    try:
        if a.wheel:
            pkg = source_from_wheel(a.wheel, work)
        elif a.src:
            pkg = a.src
        else:
            pkg = installed_package_dir()
            if pkg is None:
                log("flashinfer is not installed here: pass --wheel or --src "
                    "(pip download flashinfer-python==0.7.2 --no-deps -d /tmp/fi)")
                return 2
        tree = a.tree or (work / "slim")
        tree.mkdir(parents=True, exist_ok=True)
        out = None if a.no_tar else a.out
        if out is not None:
            ensure_ignored(out)
        if a.reuse_tree and (tree / "flashinfer" / "__init__.py").exists():
            info = {"tree": str(tree), "reused": True}
            log(f"slim: reusing {tree}")
        else:
            info = slim(pkg, out, tree, a.python, a.aot_from)
        if not info.get("reused"):
            log(f"slim: {info['files']} files, {info['raw_mib']} MiB raw" +
            (f" -> {info['out']} {info['xz_mib']} MiB" if out else "") + f" ({info['slim_s']}s)")
        rc = 0
        if out is not None and info.get("xz_mib", 0) > a.max_mib:
            log(f"FAILED: {info['xz_mib']} MiB > --max-mib {a.max_mib}")
            rc = 1
        if a.verify:
            full = pkg if not a.wheel else None
            v = verify(tree, full, a.python, work, a.modules.split(","), a.shapes.split(","), a.deps, a.compile,
                       a.jobs)
            info["verify"] = v
            if not all(v[k] for k in ("import", "backend", "jit", "deps", "compile") if k in v):
                rc = 1
        print(json.dumps(info, indent=1))
        if a.json:
            a.json.write_text(json.dumps(info, indent=1))
        return rc
    finally:
        if a.keep_work:
            log(f"work folder kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
