"""Slim FlashInfer to what SGLang 0.5.23's FlashInfer attention backend JIT-builds on Hopper, so it can travel.

The lent GPU machine receives at most 64 MiB per call (tracked tree ~8 MiB + the SGLang bundle ~31 MiB), has
no package registry, and has nvcc 13.0 + torch 2.11 + jinja2/ninja but no FlashInfer. flashinfer-python 0.7.x
is a 62 MiB wheel (593 MiB installed): it cannot travel whole. What SGLang's backend
(sglang/srt/layers/attention/flashinfer_backend.py) needs from it:

  * `import flashinfer` (its __init__ imports ~320 of its Python modules: all Python files travel, except
    `experimental/`, of which only what the import loads travels);
  * the JIT sources of the modules the backend builds on first use, for bf16/fp16 KV on sm_90:
      - fa2 batch prefill, paged + ragged (SGLang pins backend="fa2" for paged prefill; also the decode
        path when GQA group >= 4, e.g. Llama-3-8B: decode then runs through the prefill kernels),
      - fa2 batch prefill, paged-only, independent K/V strides (built lazily, only if K and V strides differ),
      - fa3 batch prefill (sm90: the ragged prefill wrapper is backend="auto", which picks fa3 on Hopper),
      - fa2 batch decode (GQA group < 4, e.g. SmolLM2's 9/3 heads),
      - cascade (merge_state: a prefix-cached extend merges the ragged and paged halves);
    plus, because an importable FlashInfer turns SGLang's default --sampling-backend into "flashinfer", the
    sampling module's sources (and norm/rope/page/top-k, ~0.1 MiB) as a fallback. That is: data/csrc's headers,
    templates and the .cu files those generators copy, FlashInfer's own headers (data/include), and the header
    libraries its ninja files put on the include path (CUTLASS/CuTe, the vendored CCCL, spdlog). Header trees
    travel whole: they compress 20-30x, and a per-file closure would depend on the host compiler.

Result: a tar.xz holding `flashinfer/` (+ its dist-info) to unpack into a folder put first on PYTHONPATH, and
flashinfer_gpu_env.sh (source it after unpacking: PYTHONPATH, the JIT cache folder, CUDA_HOME, and the
curand/libcudart/libcuda fixes a toolkit may need). On the GPU, `--warm` builds the modules in parallel before
any server starts. With --aot-from, modules already compiled (a FlashInfer JIT cache: built here with `--warm`
and CUDA 13.0's nvcc, or brought back from a GPU call) travel in flashinfer/data/aot/<name>/<name>.so, which
FlashInfer loads without compiling.

Layout: `selection` (which files travel, the slim tree, the tar.xz), `gpu_env` (flashinfer_gpu_env.sh and
CUDA home discovery), `programs` (the check and warm programs run in a fresh interpreter), `checks` (--verify),
`common` (paths, defaults, logging), `__main__` (the CLI: `python -m superinfer_sgl.flashinfer_slim --help`;
scripts/slim_flashinfer.py runs the same).

The output must not be committed: it goes to an ignored folder (.gpu_bundle/ is added to .git/info/exclude).
"""
