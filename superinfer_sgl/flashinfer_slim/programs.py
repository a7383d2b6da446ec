"""Programs run in a fresh interpreter against the slim tree (`python -S -c PROGRAM ARGS`): the import, backend
and JIT-generation checks of --verify, and WARM (--warm: build and load the modules on the GPU machine)."""

# The modules SGLang's backend builds, per (dtype, head_dim): (key, generator, args after the common ones)
JIT_MODULES = ("decode", "fa2_prefill", "fa2_prefill_paged_indep", "fa3_prefill", "cascade", "sampling", "page",
               "norm", "rope")

CHECK_IMPORT = r"""
import sys, time, importlib.util
t = time.time()
for m in ("cutlass", "cudnn", "cuda.tile", "nccl"):
    try:
        hidden = importlib.util.find_spec(m) is None
    except ModuleNotFoundError:
        hidden = True
    assert hidden, f"{m} should be hidden (absent on the GPU image)"
import flashinfer
root = sys.argv[1]
assert flashinfer.__file__.startswith(root), (flashinfer.__file__, root)
from flashinfer import (BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper,
                        BatchPrefillWithRaggedKVCacheWrapper, fast_decode_plan)
from flashinfer.cascade import merge_state
print("IMPORT_OK", flashinfer.__version__, round(time.time() - t, 1))
"""

CHECK_BACKEND = r"""
import sys, time
t = time.time()
import sglang.srt.utils as su
su.is_flashinfer_available = lambda: True          # the GPU answer (is_cuda() is False here)
import sglang.srt.utils.common as suc
suc.is_flashinfer_available = lambda: True
import sglang.srt.layers.attention.flashinfer_backend as fb
import flashinfer
assert flashinfer.__file__.startswith(sys.argv[1]), flashinfer.__file__
assert fb.BatchDecodeWithPagedKVCacheWrapper is flashinfer.BatchDecodeWithPagedKVCacheWrapper
assert fb.BatchPrefillWithRaggedKVCacheWrapper is flashinfer.BatchPrefillWithRaggedKVCacheWrapper
assert fb.merge_state is flashinfer.cascade.merge_state
import torch
print("tensor cores for Llama-3-8B decode (32/8 heads):",
      fb.should_use_tensor_core(torch.bfloat16, 32, 8), "; SmolLM2 (9/3):", fb.should_use_tensor_core(torch.bfloat16, 9, 3))
print("BACKEND_OK", round(time.time() - t, 1))
"""

CHECK_JIT = r"""
import json, os, sys, time
t = time.time()
import torch
from flashinfer.jit.attention import modules as M
from flashinfer.jit.cascade import gen_cascade_module
from flashinfer.jit import env as jit_env
root = sys.argv[1]
assert M.__file__.startswith(root), M.__file__
want = sys.argv[2].split(",")
dtypes = {"bf16": torch.bfloat16, "f16": torch.float16}
out = {"workspace": str(jit_env.FLASHINFER_WORKSPACE_DIR), "modules": {}}
for spec_s in sys.argv[3].split(","):
    dt, hd = spec_s.split(":")
    d = dtypes[dt]; hd = int(hd)
    args = (d, d, d, torch.int32, hd, hd, 0, False, False)   # posenc NONE (SGLang ropes itself), no SWA/softcap
    gens = {
        "decode": lambda: M.gen_batch_decode_module(*args),
        "fa2_prefill": lambda: M._gen_batch_prefill_primary_module("fa2", *args, False),
        "fa2_prefill_paged_indep": lambda: M._gen_batch_prefill_independent_paged_module("fa2", *args, False),
        "fa3_prefill": lambda: M.gen_batch_prefill_module("fa3", *args, False),
        "cascade": gen_cascade_module,
        "sampling": lambda: __import__("flashinfer.jit.sampling", fromlist=["x"]).gen_sampling_module(),
        "page": lambda: __import__("flashinfer.jit.page", fromlist=["x"]).gen_page_module(),
        "norm": lambda: __import__("flashinfer.jit.norm", fromlist=["x"]).gen_norm_module(),
        "rope": lambda: __import__("flashinfer.jit.rope", fromlist=["x"]).gen_rope_module(),
    }
    for key in want:
        if key in ("cascade", "sampling", "page", "norm", "rope") and spec_s != sys.argv[3].split(",")[0]:
            continue  # shape-independent
        spec = gens[key]()
        spec.write_ninja()
        srcs = [str(p) for p in spec.sources]
        for p in spec.sources:
            assert os.path.exists(p), p
        out["modules"][spec.name] = {"key": key, "shape": spec_s, "sources": srcs, "aot": spec.aot_path.exists(),
                                     "ninja": str(spec.ninja_path), "so": str(spec.jit_library_path),
                                     "commands": [c["command"] for c in spec.get_compile_commands()]}
out["s"] = round(time.time() - t, 1)
json.dump(out, open(sys.argv[4], "w"), indent=1)
print("JIT_OK", len(out["modules"]), "modules", out["s"], "s")
"""


WARM = r"""
import json, os, sys, time
t0 = time.time()
import torch
import flashinfer
from flashinfer.jit.attention import modules as M
from flashinfer.jit.cascade import gen_cascade_module
from flashinfer.jit.core import build_jit_specs
from flashinfer.jit import env as jit_env
want, shapes = sys.argv[1].split(","), sys.argv[2].split(",")
dtypes = {"bf16": torch.bfloat16, "f16": torch.float16}
specs = []
for i, spec_s in enumerate(shapes):
    dt, hd = spec_s.split(":"); d = dtypes[dt]; hd = int(hd)
    args = (d, d, d, torch.int32, hd, hd, 0, False, False)
    gens = {"decode": lambda: M.gen_batch_decode_module(*args),
            "fa2_prefill": lambda: M._gen_batch_prefill_primary_module("fa2", *args, False),
            "fa2_prefill_paged_indep": lambda: M._gen_batch_prefill_independent_paged_module("fa2", *args, False),
            "fa3_prefill": lambda: M.gen_batch_prefill_module("fa3", *args, False),
            "cascade": gen_cascade_module,
            "sampling": lambda: __import__("flashinfer.jit.sampling", fromlist=["x"]).gen_sampling_module()}
    for k in want:
        if k in ("cascade", "sampling") and i > 0:
            continue
        specs.append(gens[k]())
t1 = time.time()
build_jit_specs(specs, verbose=os.environ.get("FLASHINFER_JIT_VERBOSE") == "1")
t2 = time.time()
res = {"flashinfer": flashinfer.__file__, "jit_dir": str(jit_env.FLASHINFER_JIT_DIR), "gen_s": round(t1 - t0, 1),
       "build_s": round(t2 - t1, 1), "max_jobs": os.environ.get("MAX_JOBS"), "modules": {}}
for s in specs:
    so = s.jit_library_path
    res["modules"][s.name] = round(so.stat().st_size / 2**20, 2) if so.exists() else None
    if so.exists() and torch.cuda.is_available():
        s.load()  # tvm-ffi loads it (needs the driver: GPU machine only)
res["load_s"] = round(time.time() - t2, 1)
print(json.dumps(res, indent=1))
"""
